"""MemoryBank: FAISS search, merge and eviction rules, statistics, exact and atomic persistence."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hieragent.memory import bank as bank_mod
from hieragent.memory import store as store_mod
from hieragent.memory.bank import MemoryBank
from hieragent.memory.encoder import load_encoder

SKILLS = Path(__file__).resolve().parents[2] / "data" / "skills.jsonl"
D = 16


@pytest.fixture(scope="module")
def encoder():
    return load_encoder("minilm")  # loaded once; the bank picks it up from the process cache


def unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def random_bank(seed: int = 0, n: int = 30, **kw) -> MemoryBank:
    rng = np.random.default_rng(seed)
    bank = MemoryBank(**kw)
    bank.add([f"skill {i}" for i in range(n)], source="test", step=3, keys=unit(rng, n))
    return bank


def busy_bank() -> MemoryBank:
    """A bank that has merged, evicted and recorded uses, so every field is non-trivial."""
    rng = np.random.default_rng(7)
    bank = MemoryBank(capacity=20, merge_threshold=0.9)
    keys = unit(rng, 25)
    bank.add([f"s{i}" for i in range(25)], source="a", step=1, keys=keys)
    bank.add(["dup"], source="b", step=2, keys=keys[24:25])
    for i in bank.ids()[:8]:
        bank.record_use([i], float(rng.standard_normal()))
    return bank


def assert_banks_equal(a: MemoryBank, b: MemoryBank) -> None:
    assert a.ids() == b.ids()
    assert [a.entry(i) for i in a.ids()] == [b.entry(i) for i in b.ids()]
    ka, kb = a.keys(a.ids()), b.keys(b.ids())
    assert ka.dtype == kb.dtype == np.float32 and ka.tobytes() == kb.tobytes()
    q = unit(np.random.default_rng(99), 5, a.dim)
    for x, y in zip(a.search(q, 7), b.search(q, 7)):
        assert x.tobytes() == y.tobytes()
    assert a.events == b.events and a.dim == b.dim and a.embedder == b.embedder


def test_search_matches_float64_brute_force_and_truncates_to_bank_size():
    rng = np.random.default_rng(1)
    keys, q = unit(rng, 40), unit(rng, 6)
    bank = MemoryBank()
    ids = bank.add([str(i) for i in range(40)], keys=keys)
    got_ids, got_scores = bank.search(q, 5)
    sims = q.astype(np.float64) @ keys.astype(np.float64).T  # [6, 40]
    want = np.argsort(-sims, axis=1)[:, :5]
    assert got_ids.dtype == np.int64 and got_ids.shape == (6, 5)
    np.testing.assert_array_equal(got_ids, np.asarray(ids)[want])
    np.testing.assert_allclose(got_scores, np.take_along_axis(sims, want, 1), atol=1e-6)
    assert bank.search(q, 100)[0].shape == (6, 40)


def test_keys_are_reconstructed_bitwise_and_texts_follow_ids():
    rng = np.random.default_rng(2)
    keys = unit(rng, 10)
    bank = MemoryBank()
    ids = bank.add([f"t{i}" for i in range(10)], keys=keys)
    order = [ids[7], ids[2], ids[9]]
    assert bank.keys(order).tobytes() == keys[[7, 2, 9]].tobytes()
    assert bank.texts(order) == ["t7", "t2", "t9"]
    with pytest.raises(KeyError, match="12345"):
        bank.keys([12345])


def test_add_merges_key_above_threshold_into_existing_entry():
    rng = np.random.default_rng(3)
    base = unit(rng, 1)[0].astype(np.float64)
    noise = rng.standard_normal(D)
    noise -= (noise @ base) * base
    noise /= np.linalg.norm(noise)
    near = (0.97 * base + np.sqrt(1 - 0.97**2) * noise).astype(np.float32)  # cosine 0.97
    far = (0.90 * base + np.sqrt(1 - 0.90**2) * noise).astype(np.float32)  # cosine 0.90
    bank = MemoryBank(merge_threshold=0.95)
    [first] = bank.add(["base"], keys=base[None].astype(np.float32))
    assert bank.add(["near", "near again"], keys=np.stack([near, near])) == [first, first]
    [other] = bank.add(["far"], keys=far[None])
    assert other != first and len(bank) == 2
    assert bank.entry(first)["merges"] == 2 and bank.entry(first)["text"] == "base"
    assert dict(bank.events) == {"added": 2, "merged": 2, "evicted": 0}


def test_add_merges_a_repeated_real_text(encoder):
    bank = MemoryBank()
    ids = bank.add(["go to the red ball", "pick up the blue key"])
    assert bank.add(["go to the red ball"]) == [ids[0]]
    assert len(bank) == 2 and bank.events["merged"] == 1


def test_eviction_removes_lowest_utility_then_oldest():
    rng = np.random.default_rng(4)
    bank = MemoryBank(capacity=3, merge_threshold=1.5)  # no merging
    keys = unit(rng, 5)
    a, b, c = (bank.add([n], step=s, keys=keys[s : s + 1])[0] for n, s in (("a", 0), ("b", 1), ("c", 2)))
    bank.record_use([a], 1.0)
    bank.record_use([c], -1.0)  # c is newest but worst
    [d] = bank.add(["d"], step=3, keys=keys[3:4])
    assert sorted(bank.ids()) == sorted([a, b, d])
    [e] = bank.add(["e"], step=4, keys=keys[4:5])  # b and d tie at utility 0; b is older
    assert sorted(bank.ids()) == sorted([a, d, e])
    assert bank.events["evicted"] == 2
    assert c not in bank.search(keys, 5)[0] and b not in bank.search(keys, 5)[0]
    assert max(bank.ids()) == e == 4  # ids keep increasing; evicted ids are never reused


def test_record_use_keeps_running_mean_of_episode_returns():
    bank = random_bank(n=5)
    ids = bank.ids()
    returns = np.random.default_rng(5).standard_normal(6)
    for r in returns:
        bank.record_use([ids[0], ids[0], ids[1], 10_000, -1], float(r))  # dup counts once; unknown skipped
    for i in ids[:2]:
        assert bank.entry(i)["uses"] == 6
        assert bank.entry(i)["utility"] == pytest.approx(float(np.mean(returns.astype(np.float64))), abs=1e-12)
    assert bank.entry(ids[2])["uses"] == 0


def _only_plain_types(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _only_plain_types(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_only_plain_types(v) for v in x)
    return x is None or type(x) in (str, int, float, bool, torch.Tensor)


def test_state_dict_round_trips_exactly_through_weights_only_torch_load():
    bank = busy_bank()
    assert bank.events["merged"] == 1 and bank.events["evicted"] == 5
    state = bank.state_dict()
    assert _only_plain_types(state)
    assert state["embedder"] == "minilm" and state["dim"] == D and state["format_version"] == 3
    buf = io.BytesIO()
    torch.save({"memory": state}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["memory"]
    restored = MemoryBank(capacity=20, merge_threshold=0.9)
    restored.load_state_dict(loaded)
    assert_banks_equal(bank, restored)
    assert restored._entries._pool  # filled at load: the first eviction makes no O(N) pass
    new = unit(np.random.default_rng(8), 1)
    assert bank.add(["next"], keys=new) == restored.add(["next"], keys=new)  # id counter restored


def test_save_and_load_round_trip_exactly_without_pickle(tmp_path):
    bank = busy_bank()
    bank.save(tmp_path / "bank")
    assert sorted(os.listdir(tmp_path / "bank")) == ["entries.jsonl", "keys.npy", "meta.json"]
    np.load(tmp_path / "bank" / "keys.npy", allow_pickle=False)
    restored = MemoryBank.load(tmp_path / "bank")
    assert_banks_equal(bank, restored)
    assert (restored.capacity, restored.merge_threshold) == (20, 0.9)
    bank.add(["more"], keys=unit(np.random.default_rng(9), 1))
    bank.save(tmp_path / "bank")  # overwrite an existing bank
    assert_banks_equal(bank, MemoryBank.load(tmp_path / "bank"))
    assert os.listdir(tmp_path) == ["bank"]  # no temp or old dirs left behind


def test_failed_swap_after_temp_write_leaves_previous_bank_intact(tmp_path, monkeypatch):
    old = random_bank(seed=10, n=6)
    old.save(tmp_path / "bank")
    new = random_bank(seed=11, n=9)
    real_replace = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".bank.tmp-"):
            assert (Path(src) / "meta.json").is_file()  # the temp write was complete
            raise OSError("disk vanished")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)  # io.swap_dir renames the folder
    with pytest.raises(OSError, match="disk vanished"):
        new.save(tmp_path / "bank")
    monkeypatch.undo()
    assert_banks_equal(old, MemoryBank.load(tmp_path / "bank"))
    assert os.listdir(tmp_path) == ["bank"]


def test_failed_write_midway_leaves_previous_bank_intact(tmp_path, monkeypatch):
    old = random_bank(seed=12, n=6)
    old.save(tmp_path / "bank")
    real_write = store_mod.write_synced

    def write(path, *args, **kw):
        if Path(path).name == "meta.json":
            raise RuntimeError("killed while writing")
        return real_write(path, *args, **kw)

    monkeypatch.setattr(store_mod, "write_synced", write)
    with pytest.raises(RuntimeError, match="killed"):
        random_bank(seed=13, n=9).save(tmp_path / "bank")
    assert_banks_equal(old, MemoryBank.load(tmp_path / "bank"))
    assert os.listdir(tmp_path) == ["bank"]


def test_state_from_another_embedder_or_dim_is_refused():
    state = random_bank(n=4).state_dict()  # embedder "minilm", dim 16
    with pytest.raises(ValueError, match=r"'minilm'.*'other-encoder'"):
        MemoryBank(embedder="other-encoder").load_state_dict(state)
    wider = MemoryBank()
    wider.add(["x"], keys=unit(np.random.default_rng(0), 1, 32))
    with pytest.raises(ValueError, match=r"dim 16.*dim 32"):
        wider.load_state_dict(state)
    bad = dict(state, format_version=99)
    with pytest.raises(ValueError, match="format version 99"):
        MemoryBank().load_state_dict(bad)


def test_lazy_bank_refuses_state_whose_dim_disagrees_with_its_encoder(encoder):
    bank = MemoryBank()
    bank.load_state_dict(random_bank(n=4).state_dict())  # cheap: dim 16 accepted until embedding
    with pytest.raises(ValueError, match=r"dim 384.*dim 16"):
        bank.embed(["go to the red ball"])


def test_bank_from_checkpoint_does_not_load_the_encoder(monkeypatch):
    state = random_bank(n=8).state_dict()

    def no_load(*a, **kw):
        raise AssertionError("encoder loaded")

    monkeypatch.setattr(bank_mod, "load_encoder", no_load)
    bank = MemoryBank()
    bank.load_state_dict(state)
    assert len(bank) == 8 and bank.search(unit(np.random.default_rng(0), 2), 3)[0].shape == (2, 3)
    bank.state_dict()


def test_seed_from_shipped_skills_adds_distinct_skills(encoder):
    bank = MemoryBank()
    ids = bank.seed_from_jsonl(SKILLS)
    assert 8 <= len(bank) == len(ids) == len(set(ids))  # seed skills are far enough apart not to merge
    assert all(bank.entry(i)["kind"] == "skill" and bank.entry(i)["source"] == "seed:skills.jsonl" for i in ids)
    [red] = [i for i in ids if "red ball" in bank.texts([i])[0]]
    assert bank.search(bank.embed(["go to the red ball"]), 1)[0][0, 0] == red


@pytest.mark.parametrize(
    ("line", "message"),
    [("{not json", "not valid JSON"), ('["a list"]', "JSON object"), ('{"kind": "skill"}', "text"),
     ('{"kind": "trick", "text": "x"}', "unknown kind")],
)
def test_seed_bad_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "skills.jsonl"
    path.write_text(json.dumps({"kind": "skill", "text": "ok"}) + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"skills\.jsonl:3: .*{message}"):
        MemoryBank().seed_from_jsonl(path)
