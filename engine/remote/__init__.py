"""Remote engines: the models of an OpenAI-compatible server (vLLM, SGLang, mmserve) behind the
`ChatEngine` interface, so that the UI and the notebook drive them like the in-process engine.
Torch-free: a front end for a remote server needs neither torch nor transformers.

    config = RemoteConfig("http://gpu-box:8000/v1", api_key="...")
    engines = connect(config)            # name -> RemoteEngine, from the server's /v1/models
    llm = RemoteEngine.connect("http://gpu-box:8000/v1")  # or one model
"""

from engine.remote.config import RemoteConfig
from engine.remote.engine import RemoteEngine, connect
from engine.remote.errors import BackendError, RequestRefusedError
from engine.remote.models import ModelCard, list_models

__all__ = [
    "BackendError",
    "ModelCard",
    "RemoteConfig",
    "RemoteEngine",
    "RequestRefusedError",
    "connect",
    "list_models",
]
