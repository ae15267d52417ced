"""Every build of our C kernels, on every CPU these tests run on.

- The choice (models/kernels/cpu_variants.py): the best variant a CPU runs, MMSERVE_CPU_ISA
  forcing a lower one and refusing one the CPU lacks.
- The C harness (tests/native/harness.c: each kernel against a float64 reference) built and run
  for every variant this machine can run, only built for the x86 ones it cannot, and for aarch64
  cross-compiled and run under qemu-aarch64 on a NEON-only CPU (Cortex-A53), a dot-product one
  (Neoverse N1) and one with i8mm and bfloat16 ("max").
- The Python kernel tests run again in a subprocess per lower variant this machine can run,
  forced by MMSERVE_CPU_ISA, with PyTorch held to that level too (ATEN_CPU_CAPABILITY,
  ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS), so that an AVX-512 machine sees what an AVX2
  one runs; the subprocess
  asserts which variant it loaded (tests/test_native.py).

On CI (CI=true) a missing cross compiler or qemu fails the run; elsewhere those tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from models.kernels import cpu_variants
from models.kernels.cpu_variants import BY_NAME, VARIANTS, choose

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "models" / "kernels" / "cpu"
HARNESS = ROOT / "tests" / "native" / "harness.c"
ON_CI = os.environ.get("CI") == "true"
HERE = cpu_variants.machine_arch()
FEATURES = cpu_variants.cpu_features()
# What the CPU of each aarch64 variant is emulated as under qemu.
QEMU_CPU = {"armv8-a": "cortex-a53", "armv8.2-a+dotprod": "neoverse-n1",
            "armv8.6-a+i8mm+bf16": "max"}
# PyTorch's own kernels (ATen, oneDNN, MKL) held to a variant's level.
TORCH_LEVEL = {
    "x86-64": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
               "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "x86-64-v3": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                  "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}
KERNEL_TESTS = ["tests/test_native.py", "tests/test_quantization.py", "tests/test_panel_gemm.py",
                "tests/test_native_decode.py", "tests/test_layers.py",
                "tests/test_kernel_choice.py", "tests/test_attention.py",
                "tests/test_delta_rule.py", "tests/test_native_experts.py",
                # the ggml block kernels (not the file test: the same kernels through an engine)
                "tests/test_gguf_blocks.py::test_the_kernels_are_the_variant_chosen",
                "tests/test_gguf_blocks.py::test_dequantized_bit_for_bit_as_gguf_py",
                "tests/test_gguf_blocks.py::test_decode_and_prefill_products",
                "tests/test_gguf_blocks.py::test_a_long_prefill_in_chunks",
                "tests/test_gguf_blocks.py::test_the_repacked_layouts_hold_the_files_values",
                "tests/test_gguf_blocks.py::test_the_largest_sums_stay_exact",
                # the int8 cache's kernel: integer scores (VNNI) or the float loop (the others)
                "tests/test_kv_quant.py::test_int8_decode_attention_against_a_float_reference"]


# ---- the choice ---------------------------------------------------------------------------


ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
ZEN5 = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16",
               "avx512_vnni", "avx512vbmi"}
GRAVITON3 = frozenset({"fp", "asimd", "asimddp", "i8mm", "bf16", "sve"})


def test_the_best_variant_a_cpu_runs():
    assert choose("x86_64", ZEN3).name == "x86-64-v3"
    assert choose("x86_64", ZEN5).name == "avx512-bf16"
    assert choose("x86_64", ZEN5 - {"avx512_bf16"}).name == "avx512-vnni"
    assert choose("x86_64", ZEN5 - {"avx512_bf16", "avx512_vnni"}).name == "avx512"
    assert choose("x86_64", frozenset({"sse2"})).name == "x86-64"
    assert choose("aarch64", GRAVITON3).name == "armv8.6-a+i8mm+bf16"
    assert choose("aarch64", frozenset({"asimd"})).name == "armv8-a"
    assert choose("riscv64", frozenset()) is None


def test_forcing_a_lower_variant_and_refusing_a_higher_one():
    assert choose("x86_64", ZEN5, "x86-64-v3").name == "x86-64-v3"
    with pytest.raises(ValueError, match=r"MMSERVE_CPU_ISA='avx512-bf16' needs avx512_bf16, "
                                         r"avx512_vnni, avx512bw.* it runs x86-64, x86-64-v3"):
        choose("x86_64", ZEN3, "avx512-bf16")
    with pytest.raises(ValueError, match="needs an aarch64 CPU"):
        choose("x86_64", ZEN5, "armv8-a")
    with pytest.raises(ValueError, match="'avx3' is not a kernel variant"):
        choose("x86_64", ZEN5, "avx3")


def test_an_engine_forced_past_its_cpu_refuses_to_start(monkeypatch):
    from models.kernels import native

    higher = [v for v in VARIANTS if v.arch == HERE and not v.needs <= FEATURES]
    other = next(v for v in VARIANTS if v.arch != HERE)
    monkeypatch.setenv(cpu_variants.FORCE_ENV, (higher or [other])[0].name)
    with pytest.raises(ValueError, match="which this CPU does not have"):
        native.load()


# ---- the C harness, per variant -------------------------------------------------------------


def _compiler(arch: str) -> str | None:
    return (os.environ.get("CC") or shutil.which("cc")) if arch == HERE else shutil.which(
        f"{arch}-linux-gnu-gcc")


def _build_harness(variant, tmp_path: Path) -> Path:
    compiler = _compiler(variant.arch)
    if compiler is None:
        if ON_CI:
            pytest.fail(f"no {variant.arch} C compiler (.ci/run installs gcc-aarch64-linux-gnu)")
        pytest.skip(f"no {variant.arch} C compiler")
    exe = tmp_path / f"harness-{variant.name}"
    from models.kernels.native_build import SOURCES as KERNELS

    sources = [HARNESS, *KERNELS]
    flags = ["-O2", "-std=gnu11", "-fopenmp-simd", "-Wno-unknown-pragmas", "-fno-trapping-math",
             *variant.flags, f'-DMM_VARIANT="{variant.name}"', "-I", str(SOURCES)]

    def compile_one(source: Path) -> subprocess.CompletedProcess:
        return subprocess.run([compiler, *flags, "-c", str(source), "-o",
                               str(tmp_path / f"{source.stem}.o")],
                              capture_output=True, text=True, timeout=300)

    # one compiler per core: the sources are independent until the link
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for done in pool.map(compile_one, sources):
            assert done.returncode == 0, done.stderr[-2000:]
    static = ["-static"] if variant.arch != HERE else []
    done = subprocess.run([compiler, *static, *(str(tmp_path / f"{s.stem}.o") for s in sources),
                           "-lm", "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return exe


def _run_harness(command: list[str], variant) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith(f"variant {variant.name}\n"), done.stdout[:200]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAIL")]
    assert done.returncode == 0 and not failed, failed or done.stderr[-2000:]


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_the_harness_passes_on_every_variant(variant, tmp_path):
    exe = _build_harness(variant, tmp_path)
    if variant.arch == HERE:
        if not variant.needs <= FEATURES:
            return  # built: this CPU cannot run it
        _run_harness([str(exe)], variant)
        return
    qemu = shutil.which(f"qemu-{variant.arch}")
    if qemu is None or variant.arch != "aarch64":
        if ON_CI and variant.arch == "aarch64":
            pytest.fail("no qemu-aarch64 (.ci/run installs qemu-user)")
        pytest.skip(f"no emulator for {variant.arch}")
    _run_harness([qemu, "-cpu", QEMU_CPU[variant.name], str(exe)], variant)


def test_the_qemu_cpus_have_what_the_variants_need():
    """Each aarch64 variant's emulated CPU is the weakest one that runs it: a NEON-only CPU for
    armv8-a, so that a path needing dot products there would fault (SIGILL), not pass."""
    assert set(QEMU_CPU) == {v.name for v in VARIANTS if v.arch == "aarch64"}
    assert QEMU_CPU["armv8-a"] == "cortex-a53"  # Armv8.0: no dot products, no i8mm


# ---- the Python kernel tests, per lower variant ---------------------------------------------


LOWER = [v for v in VARIANTS if v.arch == HERE and v.needs <= FEATURES][:-1]


@pytest.mark.parametrize("variant", LOWER, ids=[v.name for v in LOWER])
def test_the_kernel_tests_pass_on_each_lower_variant(variant, tmp_path):
    env = {**os.environ, cpu_variants.FORCE_ENV: variant.name,
           **TORCH_LEVEL.get(variant.name, {})}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "-o", f"cache_dir={tmp_path}", *KERNEL_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    assert BY_NAME[variant.name]  # and test_native asserted the variant it loaded
