# SPDX-License-Identifier: Apache-2.0
"""`make tt-smoke` (demo/speculative_decoding/tt_smoke.py) on the stand-in (a TEST DOUBLE for ttnn and TT-Transformers, not a device):
every stage runs and reports, a failing target-path stage stops the run there with the failure in the report, and the
draft head's failure is its own verdict."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from models.tt_transformers.demo.speculative_decoding import build
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig
from models.tt_transformers.records import write_json_atomic
from models.tt_transformers.ttnn_backend import device as tt_device

from models.tt_transformers.demo.speculative_decoding import tt_smoke

from ..conftest import REPO_ROOT, cache_holding_the_embedded_conversion, save_tiny_hf_checkpoint
from ..tt_stand_in import install
from ..tt_stand_in import tt_transformers as stand_in_tt
from ..tt_stand_in import ttnn as stand_in_ttnn


def smoke_config(tmp_path):
    write_json_atomic(tmp_path / "p.json", [{"prompt": "Repeat: a b c d e f g a b c d e f g"}])
    return DemoConfig(backend="ttnn", draft_mode="suffix", max_generated_tokens=8, max_seq_len=256,
                           input_prompts=str(tmp_path / "p.json"))


def stand_in_machine(monkeypatch, tmp_path):
    install(monkeypatch)
    monkeypatch.setattr(stand_in_ttnn, "FABRIC", {"config": stand_in_ttnn.FabricConfig.DISABLED, "open_meshes": 0})
    monkeypatch.setattr(tt_device, "tt_device_present", lambda: True)
    monkeypatch.setenv("MESH_DEVICE", "N150")
    cache_holding_the_embedded_conversion(monkeypatch, tmp_path / "cache")


def test_every_stage_runs_and_reports(monkeypatch, tmp_path):
    stand_in_machine(monkeypatch, tmp_path)
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json")
    assert report["ok"] and [s["stage"] for s in report["stages"]] == [name for name, _ in tt_smoke.STAGES]
    facts = report["facts"]
    assert facts["device"] == "N150" and facts["model"] == "SmolLM2-135M-Instruct" and facts["mesh"] == [1, 1]
    assert facts["weight_cache"].startswith(str(tmp_path / "cache"))
    assert len(facts["verify_ids"]) == 5 and facts["perf"]["identical_to_baseline"]
    reference = facts["tt_reference"]  # TT's own decode of the prompt, the plain continuation beside it
    assert reference["ids"] == reference["plain_ids"] and reference["agreed"] == tt_smoke.REFERENCE_TOKENS
    head = facts["draft_head"]  # the shipped head on the device, its chain beside the torch head's
    assert head["head"].endswith("SmolLM2-135M-Instruct") and len(head["device_chain"]) == len(head["torch_chain"]) == 4
    assert head["first_logits_max_rel_diff"] < 0.05
    agreement = head["agreement"]  # issue 31's finding 9: over at least 32 chain steps, against the host head
    assert agreement["chain_steps"] >= tt_smoke.MIN_CHAIN_STEPS and agreement["first_draft_same"] >= 0.8
    assert json.loads((tmp_path / "report.json").read_text())["ok"]


def captures_per_stage(monkeypatch, stages):
    """The stages wrapped to count the trace captures each makes (stand-in ttnn.begin_trace_capture); (the wrapped
    stages, {stage: captures}, {"top_k": the run's drafter's top k, "traced": keys captured after each stage})."""
    captures, per_stage, seen = [], {}, {"traced": {}}
    begin = stand_in_ttnn.begin_trace_capture

    def counted(*args, **kwargs):
        captures.append(1)
        return begin(*args, **kwargs)
    monkeypatch.setattr(stand_in_ttnn, "begin_trace_capture", counted)

    def counting(name, stage):
        def run(s):
            before = len(captures)
            stage(s)
            per_stage[name] = len(captures) - before
            if s.drafter is not None:
                seen["top_k"], seen["traced"][name] = s.drafter.top_k, set(s.lm.traces)
        return run
    wrapped = [(name, counting(name, stage)) for name, stage in stages]
    # the wrappers stand for the stages: the head's stay head stages
    heads = {stage: wrapper for (_, stage), (_, wrapper) in zip(stages, wrapped) if stage in tt_smoke.HEAD_STAGES}
    monkeypatch.setattr(tt_smoke, "HEAD_STAGES", tuple(heads.values()))
    return wrapped, per_stage, seen


def test_the_first_run_captures_only_the_target_paths_traces_before_its_verdict(monkeypatch, tmp_path):
    """Issue 46, item 3: a first run's target path captures the traces it steps (the run's write-pass counts with the
    drafter's top k, and the plain step), not the tapped states' or the head's target steps; the head stage plans
    and captures its own after the target path's verdict. (The full set is the second run, --full.)"""
    from models.tt_transformers.ttnn_backend.trace_plan import trace_keys

    stand_in_machine(monkeypatch, tmp_path)
    config = smoke_config(tmp_path)
    stages, per_stage, seen = captures_per_stage(monkeypatch, tt_smoke.STAGES)
    report = tt_smoke.run(config, tmp_path / "report.json", stages)
    assert report["ok"] and report["head"]["verdict"] == "passed", report["stages"][-1]
    target = set(trace_keys(config.n_draft_tokens + 1, seen["top_k"], ()))
    assert seen["traced"]["perf keys"] == target  # every trace live at the verdict is one the target path steps
    assert per_stage["compile and trace capture"] == len(target), per_stage
    assert [name for name, n in per_stage.items() if n] == ["compile and trace capture", "draft head on the device"]
    print(f"first run: {len(target)} traces captured before the verdict; the head stage {per_stage}")


def test_each_trace_is_captured_once_across_the_stages(monkeypatch, tmp_path):
    """Review 3, item 6 (the second run, --full): the stages used to plan new shapes one by one (the tapped states'
    step, the head's target steps, the run's again after the head's warm-up), each releasing and capturing every
    trace on the mesh again. compile_and_capture keeps them all planned with --full: after it, only the head stage
    captures (its head is built with the traces live), and the tapped-states, lossless and perf stages capture
    nothing."""
    from models.tt_transformers.ttnn_backend.trace_plan import trace_keys

    stand_in_machine(monkeypatch, tmp_path)
    config = smoke_config(tmp_path)
    stages, per_stage, seen = captures_per_stage(monkeypatch, tt_smoke.FULL_STAGES)
    report = tt_smoke.run(config, tmp_path / "report.json", stages, full=True)
    assert report["ok"] and report["head"]["verdict"] == "passed", report["stages"][-1]
    captured = {name: n for name, n in per_stage.items() if n}
    assert list(captured) == ["compile and trace capture", "draft head on the device"], per_stage
    assert captured["compile and trace capture"] > len(trace_keys(config.n_draft_tokens + 1, seen["top_k"], ()))
    print(f"--full: {captured['compile and trace capture']} traces captured before the verdict; {per_stage}")


def test_a_consistently_wrong_step_passes_lossless_but_not_tts_own_decode(monkeypatch, tmp_path):
    """Review 46, finding 5: the lossless stage compares speculative with plain decoding through the same step, so a
    step that is wrong the same way every time (here: every id one past the right one) passed the target path. The
    plain continuation is also compared with TT-Transformers' own untraced decode of the prompt
    (Generator.decode_forward, host argmax), recorded before any capture; the agreement is reported either way."""
    from models.tt_transformers.ttnn_backend.causal_lm import TtnnCausalLM

    stand_in_machine(monkeypatch, tmp_path)
    step = TtnnCausalLM.step

    def off_by_one(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        out.ids = [[(i + 1) % self.vocab_size for i in row] for row in out.ids]
        return out
    monkeypatch.setattr(TtnnCausalLM, "step", off_by_one)
    stages = [("device open", tt_smoke.open_device), ("model build", tt_smoke.build_model),
              ("reference", tt_smoke.tt_reference), ("capture", tt_smoke.compile_and_capture),
              ("lossless", tt_smoke.lossless)]
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json", stages)
    reference = report["facts"]["tt_reference"]
    assert not report["ok"] and report["stages"][-1]["stage"] == "lossless", report["stages"][-1]
    assert reference["agreed"] == 1 and reference["plain_ids"][0] == reference["ids"][0]  # the prefill's: TT's own
    assert report["stages"][-1]["error"].startswith(
        "AssertionError: plain decoding's first 8 ids agree in place with TT-Transformers' own decode of the prompt "
        "on 1 (at least 6 needed)")


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


def test_a_failing_head_leaves_the_target_paths_verdict_passed_and_the_exit_status_0(monkeypatch, tmp_path, capsys):
    """Issue 46, item 3: the draft head runs after the target path with its own verdict. A head stage that raises is
    recorded as the head's failure (report "head", its stage's error, the last line printed), its later stages are
    not run, and the target path's verdict (report "ok") and the exit status stay passed (0); a target-path stage that
    fails gives exit status 1 and leaves the head not run."""
    stand_in_machine(monkeypatch, tmp_path)
    ran = []

    def no_head(*args):
        raise RuntimeError("TT_FATAL: the head's decoder layer")
    monkeypatch.setattr(tt_smoke, "smoke_head_folder", no_head)  # the device head stage fails where it starts
    stages = [("target", lambda s: ran.append("target")), ("draft head on the device", tt_smoke.device_head),
              ("tapped states", tt_smoke.tapped_states), ("after", lambda s: ran.append("after"))]
    run = tt_smoke.run
    monkeypatch.setattr(tt_smoke, "run", lambda config, path, **kwargs: run(config, path, stages, **kwargs))
    path = tmp_path / "r.json"
    assert tt_smoke.main(["--report", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["ok"] and ran == ["target", "after"]
    assert report["head"] == {"verdict": "failed", "stage": "draft head on the device",
                              "error": "RuntimeError: TT_FATAL: the head's decoder layer"}
    assert report["stages"][2] == {"stage": "tapped states",
                                   "skipped": "not run: the draft head failed at an earlier stage"}
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == ["tt-smoke verdict: target path passed (exit status 0)",
                          "tt-smoke draft head: FAILED at stage 'draft head on the device' (RuntimeError: TT_FATAL: "
                          "the head's decoder layer)"]

    def broken(s):
        raise RuntimeError("TT_FATAL: out of DRAM")
    stages[0] = ("target", broken)
    assert tt_smoke.main(["--report", str(path)]) == 1
    report = json.loads(path.read_text())
    assert not report["ok"] and report["head"] == {"verdict": "not run"} and len(report["stages"]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-2:] == [
        "tt-smoke verdict: target path FAILED at stage 'target' (exit status 1)", "tt-smoke draft head: not run"]


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

    from ..conftest import write_eagle3_head

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


class PropertyArgs:
    """A ModelArgs (TEST DOUBLE) whose vocabulary size is a property: its source holds no `self.vocab_size`."""

    def __init__(self, mesh_device, instruct=False, max_batch_size=1, max_seq_len=1024, optimizations=None):
        self.device_name, self.cluster_shape, self.num_devices, self.is_galaxy = "N150", [1, 1], 1, False
        self.dim, self.model_name, self.model_cache_path, self.n_layers = 576, "m", None, 30
        self.max_prefill_chunk_size, self.hf_config = 4096, {"vocab_size": 49152}

    @property
    def vocab_size(self):
        return self.hf_config["vocab_size"]

    get_state_dict_prefix = stand_in_tt.ModelArgs.get_state_dict_prefix
    get_residual_mem_config = stand_in_tt.ModelArgs.get_residual_mem_config
    weight_cache_path = stand_in_tt.ModelArgs.weight_cache_path
    load_state_dict = stand_in_tt.ModelArgs.load_state_dict


def test_the_surface_stage_stops_only_for_what_the_backend_calls(monkeypatch, tmp_path):
    """Issue 37 point 8: a ModelArgs attribute that is a property (no `self.<attr>` text) is found, a detail read
    from TT's source that is missing is a warning and the run goes on, and only a missing signature the backend calls
    stops the smoke at this stage."""
    from ..tt_stand_in import install

    install(monkeypatch)
    monkeypatch.setattr(stand_in_tt, "ModelArgs", PropertyArgs)

    class Attention(stand_in_tt.Attention):  # its decode reaches no ttnn.experimental.paged_update_cache text
        def forward_decode(self, x, *args, **kwargs):
            return x
    monkeypatch.setattr(stand_in_tt, "Attention", Attention)
    smoke = tt_smoke.Smoke(smoke_config(tmp_path), None)
    tt_smoke.tt_transformers_surface(smoke)
    surface = smoke.facts["tt_transformers_surface"]
    assert surface["ModelArgs attributes the backend reads"].startswith("all read attributes set")
    assert "missing" in surface["paged_update_cache looked up at call time"]
    monkeypatch.delattr(stand_in_tt.Transformer, "prepare_decode_inputs_host")
    with pytest.raises(LookupError, match="prepare_decode_inputs_host"):
        tt_smoke.tt_transformers_surface(smoke)


def test_a_literal_string_missing_from_tts_source_is_a_warning_not_a_stop(monkeypatch, tmp_path):
    """Issue 46, item 3: the Galaxy probe reads two literal strings of TT's attention.py (how a prefill fills the mesh
    columns' caches), which the lossless stage checks by running; the count prepare_decode_inputs_host returns is read
    from its source, which the first step checks. Missing (the stand-in has neither Galaxy string), each is a warning
    and the surface stage passes, where it used to stop make tt-smoke at stage 2 on a Galaxy."""
    from ..tt_stand_in import install

    install(monkeypatch)
    monkeypatch.setenv("MESH_DEVICE", "TG")
    smoke = tt_smoke.Smoke(smoke_config(tmp_path), None)
    tt_smoke.tt_transformers_surface(smoke)  # no LookupError
    surface = smoke.facts["tt_transformers_surface"]
    assert "missing" in surface["Galaxy: decode users grouped per mesh column"]
    def five_inputs(self, tokens, current_pos, page_table=None):  # as tt/model.py@000ec121 returns them
        return tokens, current_pos, None, None, page_table
    monkeypatch.setattr(stand_in_tt.Transformer, "prepare_decode_inputs_host", five_inputs)
    tt_smoke.tt_transformers_surface(smoke)
    assert "returns 5 values" in smoke.facts["tt_transformers_surface"]["prepare_decode_inputs_host returns 4 device "
                                                                        "inputs"]


def test_a_galaxy_runs_the_model_on_one_of_tts_1x8_submeshes(monkeypatch, tmp_path, embedded_checkpoint):
    """Issue 46 (Galaxy): on an 8 x 4 Galaxy the smoke stopped at model build (device.check_tensor_parallel refuses
    tensor parallelism over all 32 devices, which fails TT's own checks). It now opens the Galaxy, builds the model
    on the first of TT's create_submeshes(mesh, 4) (1 x 8, as TT runs Llama-3.1-8B there), and the taps and the
    device head run there; the trace region is sized for that submesh's model (a T3K's), not a 32-device one. The
    model splits over 8 devices as Llama-3.1-8B does (8 KV heads); the stand-in holds no 8B."""
    stand_in_machine(monkeypatch, tmp_path)
    monkeypatch.setattr(stand_in_ttnn, "AVAILABLE_DEVICES", 32)
    monkeypatch.setenv("MESH_DEVICE", "TG")
    folder = tmp_path / "Tiny-8kv-Instruct"
    save_tiny_hf_checkpoint(folder, vocab_size=49152, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                            num_hidden_layers=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the embedded model's tokenizer (its vocabulary)
        (folder / name).write_bytes((embedded_checkpoint.folder / name).read_bytes())
    config = DemoConfig(**{**vars(smoke_config(tmp_path)), "model": str(folder)})
    assert build.model_devices((8, 4)) == (["T3K", "P150x8"], 8)  # the traces are sized for the submesh's model
    seen = {}

    def model_mesh(s):
        seen.update(mesh=s.lm.tt.mesh_device, region=tt_device.TRACE_REGIONS.get(id(s.mesh)))
    stages = [("device open", tt_smoke.open_device), ("model build", tt_smoke.build_model),
              ("the model's mesh", model_mesh), ("eager prefill and verify step", tt_smoke.eager_steps),
              ("draft head on the device", tt_smoke.device_head)]
    report = tt_smoke.run(config, tmp_path / "report.json", stages, full=True)
    assert report["ok"] and report["head"]["verdict"] == "passed", report["stages"]
    assert report["facts"]["mesh"] == [8, 4] and report["facts"]["model_mesh"] == [1, 8]
    assert seen["mesh"].shape == (1, 8) and seen["region"] == report["facts"]["trace_region_size"]
    assert report["facts"]["device"] == "T3K" and len(report["facts"]["eager_verify_ids"]) == 5
    assert not tt_device.TRACE_REGIONS and not tt_device.SUBMESHES  # released with the Galaxy


def test_the_report_names_the_running_stage_and_a_watchdog_dumps_it(monkeypatch, tmp_path):
    """Issue 37 point 5: the report is on disk before a stage starts, naming it as running (what a hang leaves), a
    watchdog writes every thread's traceback beside it while the stage runs long, and the log is kept beside it."""
    path, seen = tmp_path / "report.json", []

    def slow_stage(s):
        seen.append(json.loads(path.read_text())["running"])
        time.sleep(1.5)
    report = tt_smoke.run(smoke_config(tmp_path), path, [("slow", slow_stage)], watchdog_s=0.3)
    assert report["ok"] and seen == ["slow"]
    assert json.loads(path.read_text())["running"] is None
    files = {kind: Path(p) for kind, p in report["files"].items() if kind != "ttnn_log"}
    tracebacks = files["tracebacks"].read_text()
    assert "stage 1 (slow) started" in tracebacks and "in slow_stage" in tracebacks, tracebacks
    assert "stage 1 (slow) passed" in files["log"].read_text()


CRASHING_RUN = """
import faulthandler
from pathlib import Path
from models.tt_transformers.demo.speculative_decoding import tt_smoke
from models.tt_transformers.demo.speculative_decoding.options import DemoConfig

def crashing_stage(s):
    faulthandler._sigsegv()
tt_smoke.run(DemoConfig(backend="ttnn"), Path({report!r}), [("fine", lambda s: None), ("crash", crashing_stage)])
"""


def test_a_hard_crash_leaves_the_report_and_its_traceback(tmp_path):
    """Issue 37 point 5: a stage that kills the process (a segfault in a C++ op) still leaves the report naming it as
    running, and the crash's Python traceback beside it."""
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-c", CRASHING_RUN.format(report=str(report))],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    written = json.loads(report.read_text())
    assert written["running"] == "crash" and [s["stage"] for s in written["stages"]] == ["fine"]
    tracebacks = Path(written["files"]["tracebacks"]).read_text()
    assert "Segmentation fault" in tracebacks and "in crashing_stage" in tracebacks, tracebacks
    assert written["files"]["ttnn_log"].endswith("report.json.ttnn.log")  # tt-metal's log goes beside the report


def test_a_random_head_is_gated_on_its_top_drafts_and_logits(monkeypatch, tmp_path):
    """Issue 37 point 4: where no head ships, the smoke drafts with a random head, whose top drafts are near ties: the
    host reference's weights are rounded as the device stores them (bfloat8_b), and the gate is the device's first
    draft among the host's top 3 with its first logits within the stated tolerance (the agreement is reported); the
    80 % agreement gate stays for a real head (test_every_stage_runs_and_reports,
    test_a_published_head_given_by_flag)."""
    from models.tt_transformers.checkpoints import eagle3_format

    stand_in_machine(monkeypatch, tmp_path)
    monkeypatch.setattr(tt_smoke, "smoke_head_folder", lambda *args: None)
    monkeypatch.setattr(tt_smoke, "RANDOM_DRAFT_VOCAB", 4096)  # a smaller draft vocabulary: the stand-in is slow
    random_head = eagle3_format.random_head

    def near_tied(*args, **kwargs):  # every draft token's LM-head row within a rounding step of the first's
        config, weights = random_head(*args, **kwargs)
        lm_head = weights["lm_head.weight"]
        return config, {**weights, "lm_head.weight": lm_head[:1] + 1e-3 * lm_head}
    monkeypatch.setattr(eagle3_format, "random_head", near_tied)
    stages = [("device open", tt_smoke.open_device), ("model build", tt_smoke.build_model),
              ("draft head on the device", tt_smoke.device_head)]
    report = tt_smoke.run(smoke_config(tmp_path), tmp_path / "report.json", stages)
    assert report["ok"], report["stages"][-1].get("error")
    head = report["facts"]["draft_head"]
    assert head["head"] == "random" and head["first_logits_max_rel_diff"] <= tt_smoke.FIRST_LOGITS_TOLERANCE
    print(f"random head on the stand-in: {head['agreement']}, first logits {head['first_logits_max_rel_diff']}")


def test_tap_gather_and_the_trace_region_from_the_command_line(monkeypatch, tmp_path):
    """Issue 37's third review, F3: --tap_gather host (no collective of ours inside the tapped traces: the first thing
    to rule out when the tapped-states or draft-head stage hangs on N300/T3K) reaches the model the stages run, and
    the report records it; --trace_region_size (the size a run whose traces outgrew the region names) opens the mesh
    with it. A bad value is one line."""
    stand_in_machine(monkeypatch, tmp_path)
    seen = {}

    def model_of(s):
        seen["tap_gather"] = s.lm.tap_gather
    stages = [("device open", tt_smoke.open_device), ("model build", tt_smoke.build_model), ("look", model_of)]
    run = tt_smoke.run
    monkeypatch.setattr(tt_smoke, "run", lambda config, path, **kwargs: run(config, path, stages, **kwargs))
    report = tmp_path / "r.json"
    assert tt_smoke.main(["--tap_gather", "host", "--trace_region_size", "123000000", "--report", str(report)]) == 0
    written = json.loads(report.read_text())
    assert seen == {"tap_gather": "host"} and written["settings"]["tap_gather"] == "host"
    assert written["facts"]["trace_region_size"] == 123_000_000
    tt_smoke.main(["--report", str(report)])  # the smoke's default: no collective of ours in a trace (review 3, 2)
    assert json.loads(report.read_text())["settings"]["tap_gather"] == "host"
    tt_smoke.main(["--tap_gather", "device", "--report", str(report)])
    assert json.loads(report.read_text())["settings"]["tap_gather"] == "device"
    assert json.loads(report.read_text())["facts"]["trace_region_size"] != 123_000_000  # sized by the smoke again
    with pytest.raises(SystemExit) as e:
        tt_smoke.main(["--tap_gather", "both"])
    assert e.value.code == 2


def test_the_smoke_opens_its_mesh_with_twice_the_demos_trace_region(monkeypatch, tmp_path):
    """The review's first-try risk: the trace region is an op-count estimate never measured on a device, so the smoke
    opens the mesh with the estimate x SMOKE_REGION_MARGIN (2.5, review 3) where the demo takes x 1.25."""
    from models.tt_transformers.demo.speculative_decoding.build import trace_region_size
    from models.tt_transformers.ttnn_backend import trace_plan

    stand_in_machine(monkeypatch, tmp_path)
    config = smoke_config(tmp_path)
    smoke = tt_smoke.Smoke(config, None)
    with tt_smoke.ExitStack() as exits:
        smoke.exits = exits
        tt_smoke.open_device(smoke)
        opened = smoke.facts["trace_region_size"]
    assert tt_smoke.SMOKE_REGION_MARGIN == 2.5
    demo = trace_region_size(config, (1, 1)) + tt_smoke.stages_region(config, (1, 1), margin=trace_plan.MARGIN)
    assert abs(opened / demo - 2.5 / 1.25) < 0.02, (opened, demo)


def test_the_random_heads_logits_tolerance_is_the_measured_figure_with_its_margin():
    """Issue 37's third review, F4: the random head's 5 % first-logits gate was a guess. tools/head_precision.py now
    measures how far the device head's bfloat8_b KV cache and HiFi2 matmuls alone move the first logits from the
    smoke's host reference (bf16 cache, exact matmuls), and the gate is the largest figure it recorded times the stated
    margin."""
    measured = json.loads((REPO_ROOT / "docs" / "head_precision.json").read_text())
    figures = [case["first logits, max relative difference from the smoke's reference"]
               for name, case in measured.items() if name != "chain"]
    assert tt_smoke.FIRST_LOGITS_MEASURED == max(f["KV cache bfloat8_b, HiFi2 matmuls (the device head's configs)"]
                                                 for f in figures)
    assert tt_smoke.FIRST_LOGITS_TOLERANCE == round(tt_smoke.FIRST_LOGITS_MEASURED * tt_smoke.FIRST_LOGITS_MARGIN, 4)
    assert 1 < tt_smoke.FIRST_LOGITS_MARGIN and tt_smoke.FIRST_LOGITS_TOLERANCE < 0.1  # a wrong program is off by ~1


def test_stage_1_records_the_tt_metal_checkout_and_warns_off_the_pin(tmp_path):
    """Review 3, item 8: the report names the tt-metal checkout TT-Transformers came from (`git describe --tags`), so a
    failure at a later stage is read against the right sources; a checkout that is not a git repository says so."""
    import subprocess

    checkout = tmp_path / "tt-metal"
    checkout.mkdir()
    assert tt_smoke.tt_metal_version(checkout).startswith(f"unknown ({checkout}: fatal: not a git repository")
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "release"], check=True)
    assert "No names found" in tt_smoke.tt_metal_version(checkout)  # a checkout without tags says so
    subprocess.run([*git, "tag", tt_smoke.TT_METAL_PIN], check=True)
    assert tt_smoke.tt_metal_version(checkout) == "v0.81.1"
