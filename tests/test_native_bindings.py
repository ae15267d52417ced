"""The Python side of the C interface (models/kernels/native_interface.py: signatures, structs,
constants) agrees with models/kernels/cpu/kernels.h, read as text: every exported function
with its argument count and each argument's kind (pointer, 32- or 64-bit integer, float,
double, struct), every struct's fields, every shared constant's value. A disagreement would
pass arguments in the wrong registers or at the wrong offsets, silently; here it fails by name.
Plain Python, no compiler: the compiler itself holds each source's definitions to the header's
prototypes."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from models.kernels import native_interface
from models.kernels.native_build import HEADER, SOURCES

ROOT = Path(__file__).resolve().parent.parent

# C scalar types -> the kind ctypes must pass them as
C_KINDS = {"int": "int32", "int32_t": "int32", "uint32_t": "int32", "int64_t": "int64",
           "uint64_t": "int64", "size_t": "int64", "float": "float", "double": "double",
           "void": "void"}


def _code(text: str) -> str:
    """C text without comments, with continued lines joined."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    text = re.sub(r"//[^\n]*", " ", text)
    return text.replace("\\\n", " ")


def _c_kind(declaration: str) -> tuple[str, str]:
    """'const int64_t* table' -> ('table', 'pointer'); a struct pointer names its struct."""
    declaration = re.sub(r"\bconst\b", " ", declaration).strip()
    match = re.fullmatch(r"(\w+)\s*((?:\*\s*)*)(\w*)", declaration)
    if match is None:
        return declaration, f"unparsed {declaration!r}"
    base, stars, name = match.group(1), match.group(2).replace(" ", ""), match.group(3)
    if stars:
        return name, "pointer" if base not in native_interface.STRUCTS or len(stars) > 1 \
            else f"pointer to {base}"
    if base in native_interface.STRUCTS:
        return name, f"struct {base}"
    return name, C_KINDS.get(base, f"unknown type {base}")


def _py_kind(t: type | None) -> str:
    """The kind a ctypes type passes (None: no result)."""
    if t is None:
        return "void"
    c_name = {v: k for k, v in native_interface.STRUCTS.items()}
    if isinstance(t, type) and issubclass(t, ctypes.Structure):
        return f"struct {c_name.get(t, t.__name__)}"
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        target = t._type_
        return f"pointer to {c_name[target]}" if target in c_name else "pointer"
    if t in (ctypes.c_void_p, ctypes.c_char_p):
        return "pointer"
    if t._type_ in "fdg":
        return "float" if ctypes.sizeof(t) == 4 else "double"
    return f"int{8 * ctypes.sizeof(t)}"


def prototypes(header: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The header's function declarations (not its static inline helpers): name -> (result
    kind, [(argument name, kind)])."""
    code = re.sub(r"^\s*#.*$", ";", _code(header), flags=re.M)  # a directive ends a statement
    found = {}
    declaration = r"(?:^|(?<=[;}]))\s*((?:const\s+)?\w+\s*\**)\s*(mm_\w+)\s*\(([^)]*)\)\s*;"
    for match in re.finditer(declaration, code):
        result, name, params = match.groups()
        if result.split()[0] in ("static", "return"):
            continue
        params = " ".join(params.split())
        args = [] if params in ("", "void") else [_c_kind(p) for p in params.split(",")]
        found[name] = (_c_kind(result + " x")[1], args)
    return found


def struct_fields(header: str) -> dict[str, list[tuple[str, str]]]:
    """The header's typedef'd structs: name -> [(field, kind)] in order."""
    found = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", _code(header),
                                 flags=re.DOTALL):
        fields = []
        for line in filter(None, (s.strip() for s in body.split(";"))):
            first, *rest = line.split(",")
            base = re.match(r"((?:const\s+)?\w+)", first).group(1)
            fields.append(_c_kind(first))
            fields += [_c_kind(f"{base} {declarator}") for declarator in rest]
        found[name] = fields
    return found


def constants(header: str) -> dict[str, int]:
    """The header's integer #defines and enum members."""
    code = _code(header)
    found = {name: int(value, 0) for name, value in re.findall(
        r"^\s*#\s*define\s+(\w+)\s+(-?(?:0x[0-9a-fA-F]+|\d+))[uUlL]*\s*$", code, flags=re.M)}
    for body in re.findall(r"\benum\b\s*\w*\s*\{(.*?)\}", code, flags=re.DOTALL):
        value = -1
        for member in filter(None, (m.strip() for m in body.split(","))):
            name, _, given = (part.strip() for part in member.partition("="))
            value = int(given, 0) if given else value + 1
            found[name] = value
    return found


def disagreements(header: str, signatures=native_interface.SIGNATURES,
                  structs=native_interface.STRUCTS,
                  shared=native_interface.CONSTANTS) -> list[str]:
    """Each way the table disagrees with the header's text, in words; [] when they agree."""
    problems = []
    declared = prototypes(header)
    for name in sorted(declared.keys() - signatures.keys()):
        problems.append(f"{name}: declared in kernels.h, not in the table")
    for name in sorted(signatures.keys() - declared.keys()):
        problems.append(f"{name}: in the table, not declared in kernels.h")
    for name in sorted(declared.keys() & signatures.keys()):
        (c_result, c_args), (restype, argtypes) = declared[name], signatures[name]
        if c_result != _py_kind(restype):
            problems.append(f"{name} result: {c_result} in kernels.h, {_py_kind(restype)} in "
                            "the table")
        if len(c_args) != len(argtypes):
            problems.append(f"{name}: {len(c_args)} arguments in kernels.h, {len(argtypes)} in "
                            "the table")
            continue
        for i, ((arg, kind), t) in enumerate(zip(c_args, argtypes, strict=True)):
            if kind != _py_kind(t):
                problems.append(f"{name} argument {i} ({arg}): {kind} in kernels.h, "
                                f"{_py_kind(t)} in the table")
    fields = struct_fields(header)
    for name, cls in structs.items():
        c_fields = fields.get(name)
        py_fields = [(field, _py_kind(t)) for field, t in cls._fields_]
        if c_fields is None:
            problems.append(f"struct {name}: in the table, not defined in kernels.h")
        elif c_fields != py_fields:
            problems.append(f"struct {name}: fields {c_fields} in kernels.h, {py_fields} in "
                            "the table")
    values = constants(header)
    for name, value in shared.items():
        if name not in values:
            problems.append(f"constant {name}: in the table, not defined in kernels.h")
        elif values[name] != value:
            problems.append(f"constant {name}: {values[name]} in kernels.h, {value} in the "
                            "table")
    return problems


@pytest.fixture(scope="module")
def header() -> str:
    return HEADER.read_text()


def test_the_table_agrees_with_the_header(header):
    assert prototypes(header), "no prototype parsed from kernels.h"
    assert disagreements(header) == []


def test_the_header_declares_every_function_the_sources_export(header):
    """kernels.h is the whole interface: no source exports a function it does not declare."""
    defined = set()
    for source in SOURCES:
        defined |= set(re.findall(r"^(?:const\s+)?\w+\s*\**\s*(mm_\w+)\s*\([^)]*\)\s*\{",
                                  _code(source.read_text()), flags=re.M))
    assert defined == set(prototypes(header))


@pytest.mark.parametrize("old, new, named", [
    ("void mm_rotary(", "int mm_rotary(", "mm_rotary result: int32 in kernels.h, void in"),
    ("void mm_silu_mul(const void* gate_up, void* out, int dt, int64_t rows, int64_t inner);",
     "void mm_silu_mul(const void* gate_up, void* out, int dt, int64_t rows);",
     "mm_silu_mul: 4 arguments in kernels.h, 5 in the table"),
    ("int64_t rows, int64_t inner);", "int rows, int64_t inner);",
     "mm_silu_mul argument 3 (rows): int32 in kernels.h, int64 in the table"),
    ("void mm_silu_mul(const void* gate_up,", "void mm_silu_mul(int64_t gate_up,",
     "mm_silu_mul argument 0 (gate_up): int64 in kernels.h, pointer in the table"),
    ("int64_t dim, float eps, int mode);", "int64_t dim, int eps, int mode);",
     "mm_rms_norm argument 8 (eps): int32 in kernels.h, float in the table"),
    ("int mm_moe_experts(const mm_linear_desc* gate_up,", "int mm_moe_experts(const void* gate_up,",
     "mm_moe_experts argument 0 (gate_up): pointer in kernels.h, pointer to mm_linear_desc"),
    ("int mm_ggml_takes(int type, int64_t k);", "",
     "mm_ggml_takes: in the table, not declared in kernels.h"),
    ("int mm_ggml_takes(int type, int64_t k);",
     "int mm_ggml_takes(int type, int64_t k);\nint mm_ggml_new(int type);",
     "mm_ggml_new: declared in kernels.h, not in the table"),
    ("#define DTYPE_I8 2", "#define DTYPE_I8 3", "constant DTYPE_I8: 3 in kernels.h, 2 in"),
    ("#define GGML_Q6_K 14", "", "constant GGML_Q6_K: in the table, not defined in kernels.h"),
    ("    int32_t format, group;", "    int32_t format;\n    int64_t group;",
     "struct mm_linear_desc: fields"),
    ("float eps, scale;", "double eps, scale;", "struct mm_decoder_desc: fields"),
])
def test_a_changed_header_is_named(header, old, new, named):
    assert header.count(old) == 1, f"the case's text is gone from kernels.h: {old!r}"
    problems = disagreements(header.replace(old, new))
    assert len(problems) == 1 and named in problems[0], problems


def test_no_other_module_declares_c_signatures():
    """Argument types are set in native_interface.bind alone, once per library."""
    setters = [path.relative_to(ROOT).as_posix() for path in (ROOT / "models").rglob("*.py")
               if re.search(r"\.(argtypes|restype)\s*=", path.read_text())
               and path.name != "native_interface.py"]
    assert setters == []
