"""On-disk cache of the HF config and tokenizer transformers derives from a GGUF file.

Deriving them parses the whole GGUF vocabulary in Python (seconds each); the saved
HF files load in a fraction of that. An entry is keyed by the file's real path,
size and mtime and the transformers version, so a changed file or library gets a
new entry, and it is renamed into place whole, so concurrent processes never read
half of one. Location: ``$PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``,
else ``~/.cache/pagedllm``; delete it freely.
"""

import hashlib
import logging
import os
import shutil
import tempfile

import transformers

from pagedllm.cache_dir import cache_root

logger = logging.getLogger(__name__)


def gguf_cache_dir(gguf_path: str, kind: str) -> str:
    """Directory holding ``kind`` (e.g. ``AutoConfig``) derived from this exact file."""
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    identity = f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{key}", kind)


def save_atomically(obj, target: str) -> None:
    """``obj.save_pretrained(target)`` via a temporary sibling; a failure only loses the cache."""
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
        try:
            obj.save_pretrained(tmp)
            os.rename(tmp, target)  # fails if another process got there first: theirs is as good
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.info("Not caching %s: %s", target, e)
