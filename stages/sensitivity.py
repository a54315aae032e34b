"""sensitivity (precision=mixed): rank the quantizable ops by how much quantizing each
one alone hurts the network outputs, keep for each op the threshold method that hurts
least, and choose the ops that stay in float (the qtable) so that the mixed model meets
the configured target. Skipped when plain int8 already meets it."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import onnx

from pipeline import backends, deadline, environment, shapes
from pipeline.artifacts import read_json, write_json
from pipeline.config.schemas import plain
from pipeline.precision import kinds
from pipeline.precision.calibration import sensitivity as search
from pipeline.precision.calibration import latency, selection, tables
from pipeline.precision.calibration.statistics import BatchRunner
from pipeline.precision.calibration.measure import float_outputs, output_agreement
from pipeline.data import pack
from pipeline.console import progress_bar
from pipeline.errors import ConfigError, InputError
from pipeline.task_drop import TaskDrop
from pipeline.task_metrics import files as metric_files, per_sample
from pipeline.precision.quantize import MixedModels, QdqSettings, QuantizerFailed, backend_float_ops
from stages import StageContext, StageResult, build
from stages.results import SensitivitySummary

log = logging.getLogger("parity")

NAME = "sensitivity"
CACHEABLE = True
READS = {"convert": ["model"], "calibrate": None}  # shared by the targets of one placement (key_config)
ON_MACHINE = "cpu"  # it measures on the CPU (the reference, or the runtime's CPU int8 kernels)
QTABLE_TPU_MLIR = "qtable.txt"
# model runs a validation sample one whole-model measure is estimated at before one was timed
# (then the slowest measured stands): the real-size segmenter's took about 1, PP-OCRv4 det at
# 736x736 4 while its samples ran 64 a batch (docs/time.md, eighth session)
MEASURE_RUNS = 2.0
# model runs the per-layer ranking costs per quantizable op and ranking sample (about one run
# of half the graph each; pipeline/app/budget.py counts the same)
RANKING_RUNS = 0.5


def needed(cfg) -> bool:
    return kinds.searched(cfg.precision.kind)


def key_config(cfg):
    if not needed(cfg):
        return {"needed": False}
    return {"needed": True, "sensitivity": cfg.sensitivity, "data": cfg.data, "precision": cfg.precision,
            "qdq": _settings(cfg), "measured_on": measured_on(cfg), "metric": cfg.metric,
            "goal": (goal(cfg), goal(cfg, task=True)),
            # per-op latency costs are the target's own: its threads and options are in the key
            "costs_on": cfg.target if _latency_aware(cfg) else None,
            # ops the target's int8 builds keep float (ncnn: depthwise on x86) are float here too
            "float_op_kinds": backends.float_op_kinds(backends.spec(cfg.target.backend.value), cfg.target)}


def external_files(ctx: StageContext) -> List[Path]:
    return ctx.dataset().files + metric_files(ctx.cfg.metric) if needed(ctx.cfg) else []



def _settings(cfg) -> QdqSettings:
    """The target's own Q/DQ placement: what the search selects is what the target runs."""
    return QdqSettings.resolve(cfg.precision, cfg.target.backend.value)


def measured_on(cfg) -> str:
    """The runtime the whole mixed candidates are measured on: the target's where it
    declares ``measures_qdq`` (ONNX Runtime and OpenVINO disagree by up to 0.006 in cosine
    on the same inputs-only placement of PP-OCRv4 rec: docs/sensitivity.md); else the
    reference's (ONNX Runtime)."""
    backend = cfg.target.backend.value
    return backend if backends.capabilities(backend).measures_qdq else backends.REFERENCE


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    if not needed(cfg):
        return _skipped(ctx, f"precision {cfg.precision.kind} keeps no ops in float")
    calibrate = ctx.results.get("calibrate")
    if calibrate is None or "candidates" not in calibrate.files:
        raise ConfigError("precision=mixed needs the calibrate stage before sensitivity in pipeline.stages")
    prepared = onnx.load(str(calibrate.path("prepared")))
    table = read_json(calibrate.path("table"))["tensors"]
    candidates = read_json(calibrate.path("candidates"))
    feeds, labels, count = _samples(ctx, cfg.sensitivity.samples)  # the per-layer ranking's samples
    # the skip and the selection are decided on every validation sample, the set verify judges
    measure = _measure(ctx, prepared)
    summary = {"samples": count, "judged_samples": measure.count, "reference": measure.reference_from,
               "select": cfg.sensitivity.select.value, "placement": _settings(cfg).describe(),
               "measured_on": measured_on(cfg), "expected_cos": measure.goal[0], "max_drop": measure.goal[1],
               "always_float": measure.always_float}
    known = cfg.sensitivity.int8_failed  # precision=auto's int8 candidate failed its verify: not measured again
    if known:
        summary["int8"] = {**known, "from": "the int8 candidate's verify"}
    plain = None if known else _plain(ctx, measure, table, summary)
    if plain is not None and cfg.sensitivity.select.value == "target" and measure.meets(plain):
        summary["skipped"] = "plain int8 already meets the target"
        return _write(ctx, table, [], [], summary)
    started = time.perf_counter()
    ops = search.quantizable_ops(prepared, candidates, _settings(cfg).quantize_ops)
    heads = _heads_first(cfg, measure, table, prepared, ops, summary)
    summary["refined"] = measure.refinements
    if heads:  # given back to int8 in graph order while the target holds and time is left, the last kept
        heads, given = selection.prune(measure, table, heads, summary["mixed"], {}, [], order=heads[:-1])
        last = ([p for p in given if "removed" in p] or [summary["mixed"]])[-1]
        summary["mixed"] = {k: last[k] for k in summary["mixed"]}
        inputs = search.quantized_inputs_back(measure, table, heads, summary, selection.NEXT) if _reads_int8(cfg) else []
        summary.update({"float_ops": heads, "trials": len(given), "measured": len(given), "heads_given_back": given,
                        "seconds": {"heads_first": round(time.perf_counter() - started, 2)}})
        return _write(ctx, table, heads, [], summary, cache="cut" not in summary and not measure.stopped,
                      quantized_inputs=inputs)
    plain = plain or _plain(ctx, measure, table, summary)
    if plain is None:  # the int8 build, said so; not cached
        return _write(ctx, table, [], [], summary, cache=False)
    ranked = _ranked_in_time(cfg, prepared, candidates, (feeds, labels, count), len(ops), measure, summary)
    if ranked is None:  # the int8 build, said so; not cached (a job with more time searches)
        return _write(ctx, table, [], [], summary, cache=False)
    trials, ranking = ranked
    seconds = {"per_layer": round(time.perf_counter() - started, 2)}
    best_table = _base_table(measure, prepared, (table, plain), candidates, ranking, summary)
    float_ops, curve, costs, priced = _select(ctx, measure, best_table, ranking, summary, seconds)
    summary.update({"ranking": ranking, "float_ops": float_ops, "curve": curve, "trials": len(trials),
                    "measured": sum(t.loss is not None for t in trials), "seconds": seconds,
                    "float_op_details": search.float_op_rows(float_ops, ranking, curve, costs, priced)})
    final = [p for p in curve if not p.get("kept")]
    summary["mixed"] = final[-1] if final else plain
    if deadline.passed() or measure.stopped:
        summary["cut"] = "cut by precision.budget_s: the selection stopped at the deadline with the best set measured"
    if cfg.sensitivity.select.value == "target" and not measure.meets(summary["mixed"]):
        goal_cos, goal_drop = measure.goal
        summary["warning"] = (f"the target (cosine {goal_cos}, task-metric drop <= {goal_drop}) was not reached "
                              f"with {len(float_ops)} float ops ("
                              f"{'precision.budget_s' if 'cut' in summary else 'sensitivity.max_float_ops'})")
    return _write(ctx, best_table, float_ops, trials, summary, cache="cut" not in summary)


def _plain(ctx: StageContext, measure: "_MixedMeasure", table, summary: dict) -> Optional[dict]:
    """Plain int8's measure (into ``summary``), or None where the deadline leaves no time for it
    (``summary`` says so)."""
    why = measure.no_time("the mixed search's measure of plain int8")
    if why is not None:
        summary.update({"skipped": why, "cut": why})
        return None
    try:
        plain = measure(table, [])
    except QuantizerFailed as err:
        raise err.with_run(ctx)
    summary.update({"int8": plain, "refined": measure.refinements})
    return plain


def _base_table(measure: "_MixedMeasure", prepared, calibrated: tuple, candidates, ranking: List[dict],
                summary: dict):
    """The selection's base table: each op at its best method, or calibrate's table where
    that spends less of the target (`spent`; each op's best was found with only that op in
    int8, and together they can do worse: measured on PP-OCR) or where the deadline leaves
    no time to measure it. ``calibrated``: (calibrate's table, its measure)."""
    table, measured = calibrated
    best_table = search.best_method_table(prepared, table, candidates, ranking)
    why = measure.no_time("the mixed search's measure of the per-op methods' table", new_table=True)
    combined = measure(best_table, []) if why is None else {"cut": why}
    summary["per_op_methods"] = combined
    if why is not None or selection.spent(combined, measure.goal) > selection.spent(measured, measure.goal):
        best_table = table
    summary["table"] = "per-op methods" if best_table is not table else "calibrate"
    return best_table


def _ranked_in_time(cfg, prepared, candidates, samples: tuple, ops: int, measure: "_MixedMeasure", summary: dict):
    """_ranked's (trials, ranking), or None where the deadline cuts the ranking: estimated past
    it before it starts, or passed while it runs (a ranking cut half-way ranks nothing); why
    into ``summary``."""
    why = summary.get("cut") or deadline.cut("the mixed search's per-layer ranking", RANKING_RUNS * ops * samples[2])
    if why is None:
        started = time.perf_counter()
        try:
            ranked = _ranked(cfg, prepared, candidates, samples, ops, measure.always_float, summary)
            log.debug("sensitivity: the per-layer ranking took %.1f s%s", time.perf_counter() - started, _left())
            return ranked
        except search.Stopped as stopped:
            log.debug("sensitivity: the per-layer ranking stopped after %.1f s (%s)%s", time.perf_counter() - started,
                      stopped, _left())
            why = (f"cut by precision.budget_s: the deadline passed during the mixed search's per-layer "
                   f"ranking ({stopped})")
    summary.update({"skipped": why, "cut": why})
    return None


def _left() -> str:
    """The deadline's seconds left, for parity.log (empty without a deadline)."""
    found = deadline.current()
    return "" if found is None else f", {found.left():.1f} s left before the deadline"


def _ranked(cfg, prepared, candidates, samples: tuple, ops: int, always_float: List[str], summary: dict):
    """(trials, ranking) of the per-layer search on the ranking samples; the op screen's
    note into ``summary``. An op float in every model anyway is no candidate (it would take a
    place and change nothing)."""
    feeds, labels, count = samples
    ranked = ranked_ops(cfg)
    with progress_bar() as progress:
        task = progress.add_task("sensitivity search", total=ops)
        trials = search.per_layer(prepared, candidates, feeds, count, cfg.sensitivity.methods,
                                  _settings(cfg), cfg.sensitivity.screen,
                                  progress=lambda n: progress.advance(task, n),
                                  scorer_for=lambda reference: _ranking_score(prepared, reference, labels, count, cfg),
                                  ranked=ranked, stop=deadline.loop_stop())
    ranking = [row for row in _ranking(trials, cfg) if row["op"] not in always_float]
    screened_ops = len({t.op for t in trials}) - len({t.op for t in trials if t.loss is not None})
    if screened_ops:
        summary["op_screen"] = (f"{screened_ops} of {len({t.op for t in trials})} ops were ranked by their op-level "
                                f"SQNR alone and stay int8: only the {ranked} worst (sensitivity.max_ranked) and the "
                                f"ops just before an output were measured in full")
    return trials, ranking


def _heads_first(cfg, measure: "_MixedMeasure", table, prepared, ops: List[int], summary: dict) -> List[str]:
    """Before any ranking, int8 with the output heads (search.output_heads) float, then with
    the input stems (search.input_stems) float too: the first that meets the target (each try
    into ``summary``), else []. A head's error reaches the outputs undiluted, a stem's passes
    through the whole network, and both are few (docs/sensitivity.md, "Selection")."""
    if not cfg.sensitivity.heads_first or cfg.sensitivity.select.value != "target":
        return []
    nodes = list(prepared.graph.node)
    heads, stems = ([nodes[i].name for i in found(prepared, ops) if nodes[i].name not in measure.always_float]
                    for found in (search.output_heads, search.input_stems))
    tries = {"heads_first": heads, "heads_and_stems": list(dict.fromkeys([*heads, *stems])) if stems else []}
    for key, float_ops in tries.items():
        if not float_ops or len(float_ops) > cfg.sensitivity.max_float_ops:
            continue
        why = measure.no_time(f"the mixed search's {key.replace('_', ' ')} measure")
        if why is not None:
            summary.update({key: {"float_ops": float_ops, "cut": why}, "cut": why})
            return []
        result = measure(table, float_ops)
        summary[key] = {"float_ops": float_ops, **result, "met": measure.meets(result)}
        if summary[key]["met"]:
            summary["mixed"] = result
            return float_ops
    return []


def _skipped(ctx: StageContext, why: str) -> StageResult:
    return StageResult(ctx.out_dir, {}, SensitivitySummary.from_json({"skipped": why}))


def _select(ctx: StageContext, measure: "_MixedMeasure", table, ranking: List[dict], summary: dict,
            seconds: dict):
    """(float ops, curve, per-op latency costs, priced conversions or None): the ranking's
    top_n, or the fewest float ops that meet the target (latency-aware where the target's
    costs were measured)."""
    cfg = ctx.cfg
    if cfg.sensitivity.select.value == "top_n":
        float_ops = [r["op"] for r in ranking[:cfg.sensitivity.top_n]]
        return float_ops, [{"float_ops": len(float_ops), **measure(table, float_ops)}], {}, None
    started = time.perf_counter()
    costs, measured = _costs(ctx, measure, table, ranking, summary)
    seconds["costs"] = round(time.perf_counter() - started, 2)
    up, down = latency.neighbours_each_way(measure.prepared, costs)
    priced = latency.boundary(up, down, measured, backends.capabilities(cfg.target.backend.value).conversion_passes)
    if costs:
        summary["latency"]["conversions"] = (f"priced: {priced.ms_per_element * 1e6:.3f} ms a million elements "
                                             "crossing between int8 and float" if priced else "counted as edges")
    float_ops, curve = selection.select_for_target(measure, table, ranking, cfg.sensitivity.max_float_ops, costs,
                                                   latency.either_way(up, down), priced)
    seconds["selection"] = round(time.perf_counter() - started - seconds["costs"], 2)
    return float_ops, curve, costs, priced


def ranked_ops(cfg) -> int:
    """How many ops the per-layer ranking measures in full: sensitivity.max_ranked, or
    max_float_ops (top_n at least with select=top_n)."""
    ranked = cfg.sensitivity.max_ranked or cfg.sensitivity.max_float_ops
    return max(ranked, cfg.sensitivity.top_n) if cfg.sensitivity.select.value == "top_n" else ranked


def goal(cfg, task: bool = False) -> tuple:
    """(cosine, task-metric drop) the selection reaches: sensitivity.expected_cos and
    max_drop, or where they are null (the default) the thresholds verify checks,
    validation.min_cosine (validation.task_min_cosine when a task metric is scored:
    ``task``) and max_metric_drop: a search aiming above the gate keeps ops in float that
    the gate does not need (0.999 against mixed's 0.995 kept 20 ops float on PP-OCRv4 det:
    docs/sensitivity.md). 0.999 / 0.01 where both are null."""
    cos = cfg.sensitivity.expected_cos
    if cos is None:
        gate = cfg.validation.cosine_gate(task)
        cos = gate if gate is not None else 0.999
    drop = cfg.sensitivity.max_drop
    if drop is None:
        drop = cfg.validation.max_metric_drop if cfg.validation.max_metric_drop is not None else 0.01
    return cos, drop


def _ranking_score(prepared, reference: List[np.ndarray], labels, count: int, cfg) -> Optional[TaskDrop]:
    """The task metric's drop on the ranking's samples, when a metric applies to them."""
    scorer = TaskDrop(cfg, [o.name for o in prepared.graph.output], reference, labels, count)
    return scorer if scorer.indices is not None else None


def _latency_aware(cfg) -> bool:
    """The target runs the Q/DQ model the search selects for: its per-op costs are measured."""
    return cfg.sensitivity.latency_aware and backends.capabilities(cfg.target.backend.value).qdq_latency


def _costs(ctx: StageContext, measure: "_MixedMeasure", table, ranking: List[dict], summary: dict):
    """(per-op latency cost: ms given back when the op stays float, on the target's own
    runtime, when sensitivity.latency_aware and the target runs the Q/DQ model, {} else;
    costs.json's whole measure, {} else)."""
    cfg = ctx.cfg
    backend = cfg.target.backend.value
    if not _latency_aware(cfg):
        summary["latency"] = {"skipped": "sensitivity.latency_aware is false: selection by accuracy alone"
                              if not cfg.sensitivity.latency_aware else
                              f"{backend} builds its own int8 model, not this Q/DQ one: selection by accuracy alone"}
        return {}, {}
    ops = [r["op"] for r in ranking]

    def produce(folder: Path) -> None:
        feeds = next(iter(ctx.dataset().validation)).feeds
        int8 = measure.models(table).build([])
        rewritten = _settings(cfg).rewrite_for_runtime(int8)  # as built: a widened head's int8 costs 2 ms, not 11
        costs = latency.op_costs(measure.prepared, int8, backends.spec(backend), cfg.target, feeds, ops)
        write_json(folder / "costs.json", {**costs, "int8_as_built": rewritten})

    # timed once per model, placement, target and machine: a rerun (another metric, goal or
    # candidate) reuses the times instead of taking new ones under another load
    calibrate = ctx.results["calibrate"]
    material = {"model": ctx.output_hashes.get("calibrate", {}).get(calibrate.files["prepared"]), "qdq": _settings(cfg),
                "always_float": sorted(measure.always_float), "target": plain(cfg.target), "ops": sorted(ops),
                "machine": environment.fingerprint(), "runtimes": environment.versions(), "data": plain(cfg.data)}
    folder, reused = ctx.memo("op-costs", plain(material), produce)
    measured = read_json(folder / "costs.json")
    if reused:
        measured["reused"] = "timed by an earlier run on this machine (same model, placement and target)"
    write_json(ctx.out_dir / "costs.json", measured)
    summary["latency"] = {k: v for k, v in measured.items() if k != "ops"}
    return {op: entry["cost_ms"] for op, entry in measured["ops"].items()}, measured


def _samples(ctx: StageContext, size: int):
    """The first ``size`` validation samples, packed: (feeds, labels, count). The search
    compares samples as equal slices: with samples of several shapes, those of the most
    common one (pipeline.shapes.one_shape)."""
    split = ctx.dataset().validation
    count = min(size, len(split))
    if count == 0:
        raise InputError("sensitivity: no validation samples to measure on")
    samples = shapes.one_shape([sample for _, sample in zip(range(count), split)], lambda sample: sample.feeds)
    count = len(samples)
    feeds = pack([s.feeds for s in samples])  # scalars count as [1]; BatchRunner unpacks them
    labels = [s.label for s in samples] if all(s.label is not None for s in samples) else None
    return feeds, labels, count


def _measure(ctx: StageContext, prepared: onnx.ModelProto) -> "_MixedMeasure":
    """The whole mixed models' measure on every validation sample, against verify's stored
    fp32 answers where the store holds them all for these samples (precision=auto fills it
    during int8's candidate), else against outputs computed here."""
    from stages.verify import reference_store

    dataset = ctx.dataset()
    feeds, labels, count = _samples(ctx, len(dataset.validation))
    store = reference_store(ctx, dataset) if count == len(dataset.validation) else None
    stored = store.stacked(count, [o.name for o in prepared.graph.output]) if store is not None else None
    return _MixedMeasure(prepared, feeds, labels, count, ctx.cfg, build.int8_refiner(ctx), stored=stored)


def always_float(prepared: onnx.ModelProto, cfg) -> List[str]:
    """Ops float in every mixed model, as the build keeps them: precision.keep_float and the
    quantized ops of the kinds the target's backend keeps float (Capabilities.float_op_kinds)."""
    by_backend = backend_float_ops(backends.spec(cfg.target.backend.value), cfg.target, prepared,
                                   cfg.precision.quantize_ops)
    return list(dict.fromkeys([*cfg.precision.keep_float, *by_backend]))


class _MixedMeasure:
    """The whole mixed model, really quantized (ONNX Runtime, the build's settings, the
    user's precision.keep_float in float too), on the validation samples: output cosine (as
    verify computes it), SQNR and the task metric's drop (cfg.metric, as verify scores it)
    against the float model. BatchRunner bounds how many samples one run takes."""

    def __init__(self, prepared: onnx.ModelProto, feeds, labels, count: int, cfg, refine=None, stored=None):
        """refine: all-int8 model -> (the same refined as the build refines it, summaries);
        stored: the fp32 outputs verify's reference store holds for these samples (the
        real-size segmenter's 40 took 10 s to compute again), else computed here."""
        self.prepared, self.feeds, self.labels, self.count, self.cfg = prepared, feeds, labels, count, cfg
        self.refine, self.refinements = refine, {}
        self.outputs = [o.name for o in prepared.graph.output]
        # the cosine is the float outputs' (class ids and masks: verify compares them exactly)
        self.compared = [self.outputs.index(name) for name in float_outputs(prepared)]
        self.reference_from = "verify's reference store" if stored is not None else "computed"
        reference = stored if stored is not None else BatchRunner(prepared, self.outputs, count).run(feeds, count)
        self.reference = [reference[name] for name in self.outputs]
        self.task_drop = TaskDrop(cfg, self.outputs, self.reference, labels, count)
        self.goal = goal(cfg, task=self.task_drop.indices is not None)  # a scored task metric: its cosine floor
        self.always_float = always_float(prepared, cfg)
        self._models = None
        self.seconds: Optional[float] = None  # the slowest measure's build, run and scoring so far, not its refinement
        self.refine_s = 0.0  # the last table's refinement (weight rounding, bias correction): once a table
        self._refined_in_call = 0.0
        self.stopped: Optional[str] = None  # why a measure was not started (no_time)

    def models(self, table: Dict[str, dict]) -> MixedModels:
        if self._models is None or self._models.table is not table:  # tables are never mutated
            self._models = MixedModels(self.prepared, table, _settings(self.cfg), self.always_float,
                                       None if self.refine is None else self._refined)
        return self._models

    def _refined(self, model: onnx.ModelProto) -> onnx.ModelProto:
        started = time.perf_counter()
        model, summaries = self.refine(model)
        took = time.perf_counter() - started
        self._refined_in_call += took
        # what a new table's refinement costs: the steps' own seconds, also where they came from the cache
        self.refine_s = max(took, sum(done.get("seconds", 0.0) for done in summaries.values() if done.get("enabled")))
        self.refinements = {step: bool(done.get("applied")) for step, done in summaries.items() if done.get("enabled")}
        return model

    def __call__(self, table: Dict[str, dict], float_ops: List[str], quantized_inputs: List[str] = (),
                 model: Optional[onnx.ModelProto] = None) -> dict:
        """``model``: these float ops' model where the caller built it already."""
        started, self._refined_in_call = time.perf_counter(), 0.0  # the build counts: on openvino_cpu it compiles
        model = self.models(table).build(float_ops, quantized_inputs) if model is None else model
        values = self._run(model, self.feeds, self.count)
        actual = [values[name] for name in self.outputs]
        # verify's cosine (all samples together), so that expected_cos means what the gate checks
        agreement = output_agreement([self.reference[i] for i in self.compared],
                                     [actual[i] for i in self.compared])
        result = {"cosine": agreement["cosine"], "sqnr_db": agreement["sqnr_db"],
                  "metric_drop": self.task_drop(actual), "ids_short": self._ids_short(actual)}
        took = time.perf_counter() - started
        self.seconds = max(self.seconds or 0.0, took - self._refined_in_call)
        refined = f" ({self._refined_in_call:.1f} s of it refining a new table)" if self._refined_in_call else ""
        log.debug("sensitivity: a measure with %d ops float took %.1f s%s%s", len(float_ops), took, refined, _left())
        return result

    def no_time(self, step: str, new_table: bool = False) -> Optional[str]:
        """Why ``step``, one more whole-model measure, is not started: the slowest measure so
        far (else MEASURE_RUNS model runs a sample) does not fit before the deadline; with
        ``new_table``, the step refines its table first, as long as the last refinement took.
        A refinement runs once a table: counted in every measure's estimate, it cut the
        selection on PP-OCRv4 det at "27 s" for measures of 7 s, with 23 s left."""
        if self.seconds is not None:
            estimate, how = self.seconds, "the slowest measure so far"
            if new_table and self.refine_s:
                estimate, how = estimate + self.refine_s, f"{how} and the last table's refinement"
            why = deadline.cut_seconds(step, estimate, how)
        else:
            why = deadline.cut(step, MEASURE_RUNS * self.count)
        self.stopped = self.stopped or why
        return why

    def _ids_short(self, actual: List[np.ndarray]) -> float:
        """How far the integer and boolean outputs (compared exactly by verify) fall short of
        their agreement (samples whose values all match; validation.outputs.<name>.min_agreement,
        default 1): the largest shortfall, 0 when every one holds."""
        short = 0.0
        for index, name in enumerate(self.outputs):
            if index in self.compared:
                continue
            ref, out = per_sample(self.reference[index], self.count), per_sample(actual[index], self.count)
            same = np.mean([np.array_equal(a, b) for a, b in zip(ref, out)])
            needed = self.cfg.validation.thresholds_for(name).min_agreement
            short = max(short, (1.0 if needed is None else needed) - float(same))
        return short

    def _run(self, model: onnx.ModelProto, feeds, count: int) -> Dict[str, np.ndarray]:
        runtime = measured_on(self.cfg)
        if runtime != backends.REFERENCE:
            return backends.spec(runtime).run_model(model, feeds, count, self.outputs)
        return BatchRunner(model, self.outputs, count).run(feeds, count)

    def meets(self, result: dict) -> bool:
        cos, max_drop = self.goal
        drop = result["metric_drop"]
        return result["cosine"] >= cos and (drop is None or drop <= max_drop + 1e-12) \
            and result.get("ids_short", 0.0) <= 1e-12


def badness(loss: float, metric_drop: Optional[float], cfg) -> float:
    """How much of the target's budget one op's int8 spends: its loss over the cosine budget
    (1 - target cosine), plus its task-metric drop over the allowed drop when a metric is
    measured; ops are ranked, and their methods chosen, by this."""
    cos, max_drop = goal(cfg, task=metric_drop is not None)
    spent = loss / max(1.0 - cos, 1e-9)
    if metric_drop is not None:
        spent += max(metric_drop, 0.0) / max(max_drop, 1e-9)
    return spent


def _ranking(trials, cfg) -> List[dict]:
    """One row per op, its best method by the full measure, most sensitive first."""
    best: Dict[str, search.Trial] = {}
    for trial in trials:
        if trial.loss is None:
            continue
        if trial.op not in best or (badness(trial.loss, trial.metric_drop, cfg) <
                                    badness(best[trial.op].loss, best[trial.op].metric_drop, cfg)):
            best[trial.op] = trial
    rows = [{"op": t.op, "op_type": t.op_type, "method": t.method, "loss": t.loss, "sqnr_db": t.sqnr_db,
             "metric_drop": t.metric_drop, "badness": badness(t.loss, t.metric_drop, cfg)} for t in best.values()]
    return sorted(rows, key=lambda r: -r["badness"])


def _reads_int8(cfg) -> bool:
    return backends.capabilities(cfg.target.backend.value).float_reads_int8 and _settings(cfg).derives_mixed


def _write(ctx: StageContext, table, float_ops: List[str], trials, summary, cache: bool = True,
           quantized_inputs: List[str] = ()) -> StageResult:
    write_json(ctx.out_dir / "qtable.json", {"float_ops": float_ops, "quantized_inputs": list(quantized_inputs),
                                             "select": summary["select"], "expected_cos": summary["expected_cos"]})
    (ctx.out_dir / QTABLE_TPU_MLIR).write_text(tables.to_tpu_mlir_qtable(float_ops))
    write_json(ctx.out_dir / "calibration.json", {"method": "sensitivity", "tensors": table})
    (ctx.out_dir / tables.TPU_MLIR_FILE).write_text(tables.to_tpu_mlir(table))
    write_json(ctx.out_dir / "losses.json", [vars(t) for t in trials])
    files = {"qtable": "qtable.json", "qtable_tpu_mlir": QTABLE_TPU_MLIR, "table": "calibration.json",
             "tpu_mlir": tables.TPU_MLIR_FILE, "losses": "losses.json"}
    if (ctx.out_dir / "costs.json").exists():
        files["costs"] = "costs.json"
    return StageResult(ctx.out_dir, files, SensitivitySummary.from_json(summary), cache=cache)
