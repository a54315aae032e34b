"""``parity-bundle``: check and run a packaged bundle.

    parity-bundle verify PATH   (a bundle or release folder, or its .tar.gz)
    parity-bundle run BUNDLE INPUT [--output y.npz]   (an image, .npy, .npz, or what a custom preprocess reads;
                                                       a bundle with a tokenizer: "a sentence" or a .txt/.jsonl file)
    parity-bundle check BUNDLE   (re-run the recorded verify samples: reproduce the verdict)
    parity-bundle keygen KEY     (an Ed25519 key pair for parity-release --sign; verify/check --verify-key KEY.pub)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np
from rich.markup import escape

from pipeline.app import skip_final_collection
from pipeline.release import signing
from pipeline.release.archive import is_archive, safe_extract
from pipeline.release.bundle import MANIFEST, check_integrity, open_session, read_inputs, reproduce, runtime_settings
from pipeline.console import stderr_console, stdout_console
from pipeline.errors import ExitCode, InputError, ParityError, environment_fault
from pipeline.release.publish import RELEASE_MANIFEST, check_release, is_release
from pipeline.task_metrics import load_metric


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="parity-bundle", description="Check and run a parity bundle.")
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="check every file against the manifest's sha256 "
                                                 "(a bundle or release folder, or its .tar.gz)")
    verify.add_argument("bundle", type=Path, metavar="PATH")
    verify.add_argument("--verify-key", type=Path, metavar="PUB",
                        help="an Ed25519 public key: every manifest must carry a valid signature by it")
    run = commands.add_parser("run", help="check the bundle, then run it on its backend")
    run.add_argument("bundle", type=Path)
    run.add_argument("input", nargs="?", help="an image (through the bundle's recorded preprocessing), "
                                              ".npy (one input), .npz (keys = input names), or any file "
                                              "a custom preprocess reads; a bundle packaged from text data: a text "
                                              "(quoted) or a .txt/.jsonl file of texts, one a line")
    run.add_argument("--input", dest="input_option", help="the same as INPUT")
    run.add_argument("--output", type=Path, help="write the outputs to this .npz")
    check = commands.add_parser("check", help="check the bundle, then re-run the inputs verify recorded in it "
                                               "against the recorded reference outputs and thresholds")
    check.add_argument("bundle", type=Path)
    check.add_argument("--timeout", type=float, default=600.0, help="seconds per backend request (default 600)")
    check.add_argument("--verify-key", type=Path, metavar="PUB",
                       help="an Ed25519 public key: the manifest must carry a valid signature by it")
    keygen = commands.add_parser("keygen", help="write a new Ed25519 key pair for parity-release --sign: "
                                                "KEY (private, mode 0600) and KEY.pub")
    keygen.add_argument("key", type=Path, metavar="KEY")
    args = parser.parse_args(argv)
    try:
        code = {"verify": _verify, "run": _run, "check": _check, "keygen": _keygen}[args.command](args)
    except ParityError as err:
        stderr_console().print(f"[bold red]parity-bundle:[/] {escape(str(err))}", soft_wrap=True)
        code = err.exit_code
    except Exception as err:  # noqa: BLE001
        fault = environment_fault(err)  # a full or read-only disk (e.g. --output): exit 5
        message = str(fault) if fault else f"internal error: {type(err).__name__}: {err}"
        stderr_console().print(f"[bold red]parity-bundle:[/] {escape(message)}", soft_wrap=True)
        code = fault.exit_code if fault else ExitCode.INTERNAL
    skip_final_collection()
    sys.exit(int(code))


def _verify(args) -> ExitCode:
    if not is_archive(args.bundle):
        return _verify_folder(args.bundle, args.verify_key)
    with tempfile.TemporaryDirectory(prefix="parity-verify-") as scratch:
        safe_extract(args.bundle, Path(scratch), manifests=(RELEASE_MANIFEST, MANIFEST))  # sizes checked first
        roots = list(Path(scratch).iterdir())
        if len(roots) != 1 or not roots[0].is_dir():
            raise InputError(f"archive {args.bundle} holds {len(roots)} top-level entries; "
                             f"expected one bundle or release folder")
        stdout_console().print(f"archive {escape(str(args.bundle))}: extracted safely")
        return _verify_folder(roots[0], args.verify_key)


def _verify_folder(path: Path, key: Optional[Path] = None) -> ExitCode:
    if is_release(path):
        release, bundles = check_release(path)
        if key is not None:
            signing.verify(path / RELEASE_MANIFEST, key)
            for entry in release["bundles"]:
                signing.verify(path / entry["path"] / MANIFEST, key)
        for manifest in bundles:
            _print_bundle(manifest)
        stdout_console().print(f"release {escape(release['name'])}: {len(release['files'])} files match "
                               f"release.json, {len(bundles)} bundles verified" + _signed(key))
        return ExitCode.OK
    manifest = check_integrity(path)
    if key is not None:
        signing.verify(path / MANIFEST, key)
    _print_bundle(manifest)
    if key is not None:
        stdout_console().print(f"bundle {escape(manifest['name'])}: {_signed(key).lstrip('; ')}")
    return ExitCode.OK


def _signed(key: Optional[Path]) -> str:
    return f"; signatures valid for {key}" if key is not None else ""


def _keygen(args) -> ExitCode:
    private, public = signing.generate(args.key)
    stdout_console().print(f"private key {escape(str(private))} (mode 0600: keep it secret, e.g. a CI secret), "
                           f"public key {escape(str(public))} (ship it to whoever checks the bundles)")
    return ExitCode.OK


def _print_bundle(manifest: dict) -> None:
    stdout_console().print(f"bundle {escape(manifest['name'])}: {len(manifest['files'])} files match the manifest "
                           f"(verdict at packaging: {manifest['verdict']})")


def _run(args) -> ExitCode:
    check_integrity(args.bundle)
    if (args.input is None) == (args.input_option is None):
        raise InputError("give one input file: parity-bundle run BUNDLE INPUT (an image, .npy or .npz; a text or "
                         "a .txt file for a bundle packaged from data.kind=text)")
    if args.output and not args.output.parent.is_dir():
        raise InputError(f"--output: folder {args.output.parent} does not exist")
    if args.output and args.output.is_dir():
        raise InputError(f"--output: {args.output} is a folder; give a file name such as outputs.npz")
    settings = runtime_settings(args.bundle)
    # the input's errors before any runtime loads
    samples = _samples(args.input if args.input is not None else args.input_option, settings, args.bundle)
    metric = load_metric(settings.get("metric"), root=str(args.bundle))
    session, settings = open_session(args.bundle)
    console = stdout_console()
    written = {}
    for key, title, feeds in samples:
        if len(samples) > 1:
            console.print(f"{escape(title)}")
        outputs = session.run(feeds)
        _print_outputs(console, outputs, metric)
        # several texts: keys "<line>/<output>" (the line of the text file)
        written.update({(f"{key}/{name}" if len(samples) > 1 else name): value for name, value in outputs.items()})
    if args.output:
        with open(args.output, "wb") as handle:  # the exact path: np.savez would append .npz
            np.savez(handle, **written)
        console.print(f"outputs written to {escape(str(args.output))}")
    _print_effective(console, session.effective())
    return ExitCode.OK


def _print_outputs(console, outputs: dict, metric) -> None:
    for name, value in outputs.items():
        flat = value.reshape(-1)
        console.print(f"{escape(name)}: shape {list(value.shape)} {value.dtype}, argmax {int(np.argmax(flat))}, "
                      f"first values {np.array2string(flat[:5], precision=4)}")
    decoded = _decoded(metric, outputs)
    for name, text in decoded.items():
        console.print(f"decoded {escape(name)} ({escape(metric.name)}): {escape(text)}")


def _samples(argument: str, settings: dict, bundle: Path) -> list:
    """[(key, title, feeds)] of INPUT: one file's feeds, or on a bundle packaged from text
    data each text (a quoted text, or every line of a text file: key its line number,
    titled "<file>:<line> '<text>'")."""
    from pipeline.data import text as text_data

    record = settings.get("preprocess") or {}
    if record.get("kind") == "text":
        texts = text_data.text_argument(argument)
        if texts is not None:
            specs = [(spec["name"], spec["dtype"]) for spec in settings["inputs"]]
            encode = text_data.bundle_encoder(bundle, record, specs)
            return [(name.rpartition(":")[2], f"{name} {_short(text)}", _conformed(encode(text), settings, name))
                    for name, text in texts]
    path = Path(argument)
    if not path.exists():
        text = "; this bundle has no tokenizer to read it as text (it was not packaged from data.kind=text)" \
            if record.get("kind") != "text" and (not path.suffix or any(c.isspace() for c in argument)) else ""
        raise InputError(f"--input: {argument} does not exist{text}")
    return [("", str(path), _feeds(path, settings))]


def _short(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[:width - 3] + "...")


def _conformed(arrays: dict, settings: dict, where: str) -> dict:
    from pipeline.data import TensorSpec, conform

    specs = [TensorSpec(**spec) for spec in settings["inputs"]]
    return {s.name: conform(arrays[s.name], s, where, label="--input") for s in specs}


NUMPY_MAGIC = {".npy": b"\x93NUMPY", ".npz": b"PK"}


def _feeds(path: Path, settings: dict) -> dict:
    """The model's feeds from a user's file: .npy/.npz as tensors, anything else through
    the preprocessing the bundle recorded (images, or a custom preprocess)."""
    from pipeline.data import IMAGE_SUFFIXES, DataKind, TensorSpec, file_reader, preprocess_from_record

    if not path.exists():
        raise InputError(f"--input: {path} does not exist")
    if not path.is_file():
        raise InputError(f"--input: {path} is not a file")
    suffix = path.suffix.lower()
    record = settings.get("preprocess")
    if suffix in NUMPY_MAGIC:
        with open(path, "rb") as handle:
            if not handle.read(6).startswith(NUMPY_MAGIC[suffix]):
                raise InputError(f"--input: {path} is not a NumPy {suffix} file (wrong contents for its name); "
                                 "save it with numpy.save / numpy.savez")
        return read_inputs(path, settings)
    if record is None:
        kinds = "an image, " if suffix in IMAGE_SUFFIXES else ""
        raise InputError(f"--input: {path} is {kinds or 'a ' + (suffix or 'suffix-less') + ' file, '}but this bundle "
                         "records no preprocessing (built from tensor data); give a .npy or .npz file")
    kind, pre = preprocess_from_record(record)
    if kind is DataKind.images and suffix not in IMAGE_SUFFIXES:
        raise InputError(f"--input: {path}: unsupported file type {suffix or '(none)'!r}; give an image "
                         f"({', '.join(IMAGE_SUFFIXES)}), a .npy or a .npz file")
    specs = [TensorSpec(**spec) for spec in settings["inputs"]]
    return file_reader(kind, pre, specs, label="--input")(path)


def _decoded(metric, outputs: dict) -> dict:
    """The metric's decoding of its output (ctc: the text; detection: the boxes as JSON),
    where it has a decoder; a pair metric's (a detector's boxes and scores) of its two
    outputs together, named "boxes, scores"."""
    decode = metric.hook("decode") if metric else None
    if decode is None or not outputs:
        return {}
    if len(metric.names) > 1:
        if any(name not in outputs for name in metric.names):
            return {}
        return {", ".join(metric.names): str(metric.call(decode, tuple(outputs[name] for name in metric.names)))}
    name = metric.output if metric.output in outputs else next(iter(outputs))
    text = metric.call(decode, outputs[name])
    return {name: str(text)}


def _print_effective(console, effective: dict) -> None:
    """What ran, the compile cache's status and the runtime options read back from the runtime."""
    shown = {key: value for key, value in effective.items() if key not in ("runtime_options", "compile_cache")}
    console.print(f"ran on: {escape(str(shown))}")
    if "compile_cache" in effective:
        console.print(f"compile cache: {escape(str(effective['compile_cache']))}")
    options = effective.get("runtime_options") or {}
    if options:
        console.print("runtime options (read back): " + escape(", ".join(f"{k}={v}" for k, v in options.items())))


def _check(args) -> ExitCode:
    check_integrity(args.bundle)
    if args.verify_key is not None:
        signing.verify(Path(args.bundle) / MANIFEST, args.verify_key)
    result = reproduce(args.bundle, args.timeout)
    console = stdout_console()
    for output in result["outputs"]:
        metrics = output["metrics"] or {}
        status = "pass" if output["passed"] else "fail: " + "; ".join(output["failures"])
        console.print(f"{escape(output['name'])}: cosine {metrics.get('cosine', float('nan')):.6f}, "
                      f"max abs {metrics.get('max_abs', float('nan')):.3g} -> {escape(status)}")
    _print_effective(console, result["effective"])
    basis = ("the bundle reproduces the packaged run's outputs: its accuracy on the whole validation set stands, "
             "device and precision judged on this machine" if result["reproduced"] else
             f"outputs differ from the packaged run's: judged on the {result['samples']} recorded samples")
    console.print(f"{escape(basis)}")
    console.print(f"verdict: {result['verdict'].upper()} (exit {result['exit_code']}; packaged verdict: "
                  f"{result['packaged_verdict']}, exit {result['packaged_exit_code']})")
    for reason in result["reasons"]:
        console.print(f"  - {escape(reason)}")
    return ExitCode(result["exit_code"])
