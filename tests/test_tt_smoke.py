# SPDX-License-Identifier: Apache-2.0
"""`make tt-smoke` (tools/tt_smoke.py) on the stand-in (a TEST DOUBLE for ttnn and TT-Transformers, not a device):
every stage runs and reports, and a failing stage stops the run there with the failure in the report."""
import json
import sys

from models.tt_transformers.demo.speculative_decoding.options import DemoConfig
from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.ttnn_backend import device as tt_device

from .conftest import REPO_ROOT
from .tt_stand_in import install
from .tt_stand_in import ttnn as stand_in_ttnn

sys.path.insert(0, str(REPO_ROOT / "tools"))

import tt_smoke  # noqa: E402


def smoke_config(tmp_path):
    write_json_atomic(tmp_path / "p.json", [{"prompt": "Repeat: a b c d e f g a b c d e f g"}])
    return DemoConfig(backend="ttnn", draft_mode="suffix", max_generated_tokens=8, max_seq_len=256,
                           input_prompts=str(tmp_path / "p.json"))


def stand_in_machine(monkeypatch, tmp_path):
    install(monkeypatch)
    monkeypatch.setattr(stand_in_ttnn, "FABRIC", {"config": stand_in_ttnn.FabricConfig.DISABLED, "open_meshes": 0})
    monkeypatch.setattr(tt_device, "tt_device_present", lambda: True)
    monkeypatch.setenv("MESH_DEVICE", "N150")
    monkeypatch.setenv("TT_CACHE_PATH", str(tmp_path / "cache"))


def test_every_stage_runs_and_reports(monkeypatch, tmp_path):
    stand_in_machine(monkeypatch, tmp_path)
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json")
    assert report["ok"] and [s["stage"] for s in report["stages"]] == [name for name, _ in tt_smoke.STAGES]
    facts = report["facts"]
    assert facts["device"] == "N150" and facts["model"] == "SmolLM2-135M-Instruct" and facts["mesh"] == [1, 1]
    assert facts["weight_cache"].startswith(str(tmp_path / "cache"))
    assert len(facts["verify_ids"]) == 5 and facts["perf"]["identical_to_baseline"]
    head = facts["draft_head"]  # the shipped head on the device, its chain beside the torch head's
    assert head["head"].endswith("SmolLM2-135M-Instruct") and len(head["device_chain"]) == len(head["torch_chain"]) == 4
    assert head["first_logits_max_rel_diff"] < 0.05
    agreement = head["agreement"]  # issue 31's finding 9: over at least 32 chain steps, against the host head
    assert agreement["chain_steps"] >= tt_smoke.MIN_CHAIN_STEPS and agreement["first_draft_same"] >= 0.8
    assert json.loads((tmp_path / "report.json").read_text())["ok"]


def test_a_failing_stage_stops_the_run(monkeypatch, tmp_path):
    stand_in_machine(monkeypatch, tmp_path)
    ran = []

    def broken(s):
        raise RuntimeError("TT_FATAL: out of DRAM")
    stages = [("device open", tt_smoke.open_device), ("model build", broken), ("after", lambda s: ran.append(1))]
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json", stages)
    assert not report["ok"] and ran == [] and len(report["stages"]) == 2
    assert report["stages"][-1]["error"] == "RuntimeError: TT_FATAL: out of DRAM"
    assert "out of DRAM" in report["stages"][-1]["traceback"]
    assert stand_in_ttnn.FABRIC["open_meshes"] == 0  # the mesh was closed on the way out


def test_the_report_survives_a_failed_teardown(monkeypatch, tmp_path):
    """The report a TT user is told to send back is written before the teardown and again after it: a capture that
    fails and a trace that then will not release still leave the stage's failure, and the teardown's, on disk."""
    stand_in_machine(monkeypatch, tmp_path)

    def refuse():
        raise RuntimeError("TT_THROW: trace in use")

    def capture_fails(s):
        s.exits.callback(refuse)
        raise RuntimeError("TT_FATAL: capture failed")
    stages = [("device open", tt_smoke.open_device), ("compile and trace capture", capture_fails)]
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json", stages)
    assert not report["ok"] and report["teardown"] == "RuntimeError: TT_THROW: trace in use"
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["stages"][-1]["error"] == "RuntimeError: TT_FATAL: capture failed"
    assert written["teardown"] == report["teardown"]
    assert stand_in_ttnn.FABRIC["open_meshes"] == 0  # the mesh still closed


def test_a_published_head_given_by_flag(monkeypatch, tmp_path):
    """`make tt-smoke ARGS='--draft_head FOLDER'` runs the draft-head stage on that head (issue 31's finding 9), its
    drafts compared with the host head's over at least 32 chain steps; a folder that is not there stops the run at
    its first stage that needs the head (device open: the trace region is sized for it), in the report."""
    from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
    from models.tt_transformers.checkpoints.model_shape import ModelShape

    from .conftest import write_eagle3_head

    stand_in_machine(monkeypatch, tmp_path)
    args = ModelShape.from_hf_config(resolve_checkpoint(None).config)
    folder = write_eagle3_head(tmp_path / "published", args, draft_vocab=20000, std=0.3)
    stages = [("device open", tt_smoke.open_device), ("model build", tt_smoke.build_model),
              ("draft head on the device", tt_smoke.device_head)]
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json", stages, draft_head=str(folder))
    assert report["ok"], report["stages"][-1].get("error")
    head = report["facts"]["draft_head"]
    assert head["head"] == str(folder) and head["agreement"]["chain_steps"] >= tt_smoke.MIN_CHAIN_STEPS
    assert tt_smoke.main(["--draft_head", str(tmp_path / "missing"), "--report", str(tmp_path / "r.json")]) == 1
    failed = json.loads((tmp_path / "r.json").read_text())["stages"][-1]
    assert failed["stage"] == "device open" and "missing" in failed["error"]
