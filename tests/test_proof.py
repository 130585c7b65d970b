"""The runtime proof: every fixture pair replayed on a tiny real model against one full batch.

Before the fix the gradient must differ from the full batch (relative error > 1e-3); after it
must match to float precision (< 1e-5). Real torch + transformers on CPU, no mocks.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import FIXTURES, gaaudit
from gaaudit.verify import VERIFIED, Options, _replay, targets

PAIRS = sorted(FIXTURES.glob("*.fixed.py"))

# Unsafe fixes that count every target (no ignore value is visible in the file): on padded
# data they are wrong, and the replay must say so rather than call them verified.
UNSAFE = {"ga001_exact_nanogpt_memmap_scaler", "ga002_nanogpt_micro_loop_no_division"}

# Loops the statement replay cannot run yet; each must say so (never crash, never verify).
NOT_REPLAYABLE = {
    "ga001_ddp_no_sync_chunks", "ga001_exact_image_cls_drop_last",
    "ga001_explicit_cross_entropy_ignore_index", "ga001_grad_data_div_lstm_nll",
    "ga001_grad_inplace_div_modulo", "ga001_inplace_accum_iter_vit",
    "ga001_trainer_class_self_criterion", "ga002_amp_scaler_segmentation",
    "ga002_micro_batch_list_bart",
}


def replayed(pair: Path, k: int = 4) -> list[dict]:
    original = pair.with_name(pair.name.replace(".fixed.py", ".py"))
    before, after = original.read_bytes(), pair.read_bytes()
    job = {
        "original": before.decode(), "patched": after.decode(),
        "targets": [asdict(t) for t in targets(before, after)],
        "options": asdict(Options(ks=(k,), device="cpu", timeout=60)), "filename": str(original),
    }
    return _replay(job)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p.name.removesuffix(".fixed.py"))
def test_fixture_pair_before_differs_after_matches(pair):
    name = pair.name.removesuffix(".fixed.py")
    outcomes = replayed(pair)
    assert outcomes, "no loop found to replay"
    for outcome in outcomes:
        (row,) = outcome["rows"]
        if name in NOT_REPLAYABLE:
            assert row["verdict"].startswith("not replayable: "), row
            continue
        assert row["original_verdict"] == "bug reproduced" and row["original_error"] > 1e-3, row
        if name in UNSAFE:
            assert row["verdict"] != VERIFIED and row["patched_error"] > 1e-3, row
        else:
            assert row["verdict"] == VERIFIED and row["patched_error"] < 1e-5, row


def test_most_pairs_are_proven():
    proven = [p for p in PAIRS if p.name.removesuffix(".fixed.py") not in NOT_REPLAYABLE | UNSAFE]
    assert len(proven) >= 12


def test_verify_cli_table_json_and_exit_codes(tmp_path):
    script = tmp_path / "train.py"
    script.write_bytes((FIXTURES / "ga001_hf_mlm_bert.py").read_bytes())
    result = gaaudit("verify", str(script), "-k", "2,4", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"executing loops of {script}" in result.stderr
    assert result.stdout.count("verified") == 2
    data = json.loads(gaaudit("verify", f"{script}:76", "-k", "4", "--format", "json").stdout)
    (loop,) = data["loops"]
    assert loop["verdict"] == VERIFIED and loop["rows"][0]["original_error"] > 1e-3
    unreplayable = tmp_path / "vit.py"
    unreplayable.write_bytes((FIXTURES / "ga001_inplace_accum_iter_vit.py").read_bytes())
    result = gaaudit("verify", str(unreplayable), "-k", "4")
    assert result.returncode == 2 and "not replayable: " in result.stdout
    assert "Traceback" not in result.stderr


def test_verify_times_out_a_hanging_loop(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        "import time\nfor step, batch in enumerate(loader):\n    time.sleep(1000)\n"
        "    loss = model(**batch).loss / accum_steps\n    loss.backward()\n"
        "    if (step + 1) % accum_steps == 0:\n        optimizer.step()\n"
    )
    result = gaaudit("verify", str(script), "-k", "2", "--timeout", "20")
    assert result.returncode == 2 and "not replayable" in result.stdout


def test_fix_verify_holds_back_what_it_cannot_prove(tmp_path, cli):
    for name in ("ga001_hf_mlm_bert.py", "ga001_inplace_accum_iter_vit.py"):
        (tmp_path / name).write_bytes((FIXTURES / name).read_bytes())
    result = cli("fix", ".", "--verify", cwd=tmp_path)
    assert "ga001_inplace_accum_iter_vit.py: fixes held back: line 80: not replayable" in result.output
    assert (tmp_path / "ga001_hf_mlm_bert.py").read_bytes() == (FIXTURES / "ga001_hf_mlm_bert.fixed.py").read_bytes()
    assert (tmp_path / "ga001_inplace_accum_iter_vit.py").read_bytes() == (
        FIXTURES / "ga001_inplace_accum_iter_vit.py"
    ).read_bytes()


def test_demo_error_grows_with_k_and_sum_and_count_is_exact(tmp_path):
    result = gaaudit("verify", "--demo", "--format", "json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["k"] for r in rows] == list(range(1, 33))
    assert rows[0]["mean_over_k"] < 1e-5
    assert all(r["mean_over_k"] > 1e-3 for r in rows[1:])
    assert rows[-1]["mean_over_k"] > rows[1]["mean_over_k"]
    assert all(r["sum_and_count"] < 1e-5 for r in rows)
