"""A fp32 build's drop that float reordering alone produces passes, and says why; a real
fault, or a build at a lower precision, is judged by its allowed drop as before
(pipeline/verification/float_noise.py). The CLI side: tests/test_segmenter.py."""

from pipeline.verification import float_noise


def _task(drop, interval, passed=False):
    return {"metric": "map_iou", "output": "1959", "drop": drop, "interval": interval, "max_drop": 0.0,
            "passed": passed, "reason": f"task metric map_iou dropped by {drop}"}


def _output(name="1959", worst=0.9999999, failures=()):
    return {"name": name, "failures": list(failures), "metrics": {"min_sample_cosine": worst, "cosine": worst}}


def test_a_few_flipped_pixels_on_fp32_pass_as_float_noise():
    judged = float_noise.judged(_task(3.7e-06, [0.0, 8.6e-06]), [_output()], "fp32")
    assert judged["passed"] is True and "reason" not in judged
    assert "float noise" in judged["float_noise"] and "reaches 0" in judged["float_noise"]


def test_a_small_drop_on_every_sample_is_noise_too():
    judged = float_noise.judged(_task(2e-4, [1e-4, 3e-4]), [_output()], "fp32")
    assert judged["passed"] is True and "at most" in judged["float_noise"]


def test_a_map_broken_on_one_sample_is_a_fault_not_noise():
    """One sample's map wrong on the target: its cosine falls far below float level, even
    when the drop's interval reaches 0 (one sample of forty)."""
    task = _task(0.02, [0.0, 0.06])
    assert float_noise.judged(task, [_output(worst=0.93)], "fp32") is task


def test_a_large_drop_on_many_samples_is_not_noise():
    task = _task(0.01, [0.006, 0.014])
    assert float_noise.judged(task, [_output()], "fp32") is task


def test_an_output_that_fails_its_checks_is_not_noise():
    task = _task(1e-5, [0.0, 3e-5])
    other = _output(name="1960", failures=["cosine 0.98 < 0.9999"])
    assert float_noise.judged(task, [_output(), other], "fp32") is task


def test_only_the_reference_precision_gets_the_rule():
    """int8 and the other quantized builds have their own allowed drop (0.01 by default)."""
    for precision in ("int8", "mixed", "fp16", "bf16"):
        task = _task(3.7e-06, [0.0, 8.6e-06])
        assert float_noise.judged(task, [_output()], precision) is task


def test_a_passing_task_is_left_alone():
    task = _task(0.0, [0.0, 0.0], passed=True)
    assert float_noise.judged(task, [_output()], "fp32") is task
    assert float_noise.judged(None, [], "fp32") is None


def test_a_negative_allowed_drop_is_never_met_by_noise():
    """max_drop < 0 asks the build to beat the reference: a drop of 0 fails as before."""
    task = {**_task(0.0, [0.0, 0.0]), "max_drop": -0.01}
    assert float_noise.judged(task, [_output()], "fp32") is task
