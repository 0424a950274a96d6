"""``make ablation-memory`` runs its bank variants end to end (one update each)."""

import csv

from hieragent.bench.memory_ablation import VARIANTS, main


def test_ablation_runs_every_variant_with_the_bank_it_names(tmp_path, capsys):
    main(["--seeds", "0", "--batches", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for name, _ in VARIANTS:
        assert name in out
    runs = sorted(tmp_path.glob("run*/lightning_logs/tiny_learn/version_0/metrics.csv"))
    assert len(runs) == len(VARIANTS) == 4
    headers = []
    for path in runs:
        with open(path, newline="") as f:
            headers.append(set(next(csv.reader(f))))
    no_bank, fixed, evolving, contrastive = headers
    assert "bank/size" not in no_bank  # really ran without a bank
    assert "bank/size" in fixed and "bank/size" in evolving
    assert "memory/contrastive_loss" in contrastive and "memory/contrastive_loss" not in evolving
    with open(runs[1], newline="") as f:  # the fixed bank added nothing
        assert all(float(r["bank/added"] or 0) == 0 for r in csv.DictReader(f) if r.get("bank/added"))
