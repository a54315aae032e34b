"""data.kind=text: texts as model inputs for transformer models, through a Hugging Face
``tokenizers`` tokenizer (a ``tokenizer.json``). Each text is tokenized on its own at its
natural length (no padding; ``data.max_length`` truncates), batch 1: arrays [1, seq] that
fill the model's inputs by name (``FILLED``), in each input's dtype.

Where texts come from (``open_texts``): a folder with ``calibration.txt`` and
``validation.txt``, or one ``.txt`` / ``.jsonl`` file whose first ``data.calibration_size``
texts (null: half of them, at most ``data.calibration_cap``) calibrate and whose rest
validates. A ``.txt`` holds one text a line, a ``.jsonl`` one JSON object a line with a
"text" field; blank lines are skipped. The bundle records the tokenizer (``text_record``)
and ``parity-bundle run`` encodes texts with it (``bundle_encoder``).

``tokenizers`` is an optional dependency (``pip install 'parity[text]'``), imported only
here, inside functions. This module imports nothing of ``pipeline.data``, which builds the
samples from what it returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from pipeline.config.schemas import DataConfig
from pipeline.errors import ConfigError, InputError

# model input name -> the tokenizers Encoding attribute that fills it
FILLED = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
TEXT_SUFFIXES = (".txt", ".jsonl")
SPLIT_FILES = {"calibration": "calibration.txt", "validation": "validation.txt"}
BUNDLE_TOKENIZER = "tokenizer.json"  # the tokenizer's name inside a bundle

Texts = List[Tuple[str, str]]  # (sample name "file:line", text)


@dataclass
class TextSource:
    """The texts of each split, where they come from, and the files read (for cache keys)."""

    texts: Dict[str, Texts]
    sources: Dict[str, str]
    files: List[Path] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)


def load_tokenizer(path, max_length: Optional[int] = None, label: str = "data.tokenizer"):
    """The tokenizer of a ``tokenizer.json``, padding off (every text at its own length),
    truncated to ``max_length`` tokens when given (else as the file says)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("text inputs (data.kind=text) need the tokenizers package: pip install 'parity[text]' "
                          "(or pip install 'tokenizers>=0.19')") from None
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"{label}: {path} does not exist (give the path of a tokenizer.json, the Hugging Face "
                         "tokenizers format)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - tokenizers raises its own Exception types
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"{label}: {path} cannot be read as a tokenizers tokenizer.json ({first})") from None
    tokenizer.no_padding()
    if max_length is not None:
        tokenizer.enable_truncation(max_length)
    return tokenizer


def check_inputs(names: Sequence[str], label: str = "data") -> None:
    """An InputError naming the first model input a tokenizer cannot fill."""
    unknown = [name for name in names if name not in FILLED]
    if unknown:
        raise InputError(f"{label}: model input '{unknown[0]}' cannot be filled from text (data.kind=text fills "
                         f"inputs named {', '.join(FILLED)}); rename the model's input or give tensor data")


class Encoder:
    """text -> {input name: array [1, seq]} in each input's dtype."""

    def __init__(self, tokenizer_path, max_length: Optional[int], inputs: Sequence[Tuple[str, str]],
                 label: str = "data", tokenizer_label: str = "data.tokenizer"):
        check_inputs([name for name, _ in inputs], label)
        self.path = Path(tokenizer_path).expanduser()
        self.tokenizer = load_tokenizer(self.path, max_length, tokenizer_label)
        self.inputs = list(inputs)

    def __call__(self, text: str) -> Dict[str, np.ndarray]:
        encoding = self.tokenizer.encode(text)
        return {name: np.asarray([getattr(encoding, FILLED[name])], dtype=np.dtype(dtype))
                for name, dtype in self.inputs}


def read_texts(path: Path, label: str = "data") -> Texts:
    """(name, text) for every non-blank line of a .txt file, or the "text" of every object
    of a .jsonl file (any other suffix: read as .txt); names are "<file>:<line>"."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise InputError(f"{label}: {path} is not a UTF-8 text file ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise InputError(f"{label}: {path} cannot be read ({err.strerror or err})") from None
    texts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        texts.append((f"{path.name}:{number}",
                      _json_text(line, path, number, label) if path.suffix.lower() == ".jsonl" else line))
    return texts


def _json_text(line: str, path: Path, number: int, label: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as err:
        raise InputError(f"{label}: {path}:{number} is not a JSON object ({err})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise InputError(f"{label}: {path}:{number}: expected an object with a \"text\" string field")
    return record["text"]


def open_texts(cfg: DataConfig) -> TextSource:
    """The texts of data.path: a folder's calibration.txt and validation.txt, or one .txt
    / .jsonl file split in two (module docstring)."""
    path = Path(cfg.path).expanduser()
    if not path.exists():
        raise InputError(f"data.path: {path} does not exist (data.kind=text: a folder with calibration.txt and "
                         "validation.txt, or one .txt / .jsonl file)")
    if path.is_file():
        return _single_file(path, cfg)
    files = {split: path / name for split, name in SPLIT_FILES.items() if (path / name).is_file()}
    if "validation" not in files:
        raise InputError(f"data.path: {path} has no validation.txt (data.kind=text: calibration.txt and "
                         "validation.txt, one text a line)")
    warnings = []
    if "calibration" not in files:
        files["calibration"] = files["validation"]
        warnings.append(f"no calibration.txt in {path}: calibration uses validation.txt")
    texts = {split: read_texts(file) for split, file in files.items()}
    for split, found in texts.items():
        if not found and (split == "validation" or cfg.calibration_size != 0):
            raise InputError(f"data.path: {files[split]} holds no texts (one text a line, blank lines skipped)")
    return TextSource(texts, {split: str(file) for split, file in files.items()},
                      sorted(set(files.values())), warnings)


def _single_file(path: Path, cfg: DataConfig) -> TextSource:
    if path.suffix.lower() not in TEXT_SUFFIXES:
        raise InputError(f"data.path: {path} is a file; data.kind=text reads a .txt or .jsonl file, or a folder "
                         "with calibration.txt and validation.txt")
    texts = read_texts(path)
    count = cfg.calibration_size if cfg.calibration_size is not None \
        else min(len(texts) // 2, cfg.calibration_cap)
    if len(texts) <= count:
        raise InputError(f"data.path: {path} holds {len(texts)} texts and the first {count} calibrate "
                         "(data.calibration_size): none is left for validation")
    return TextSource({"calibration": texts[:count], "validation": texts[count:]},
                      {"calibration": f"{path}[:{count}]", "validation": f"{path}[{count}:]"}, [path])


def text_record(cfg: DataConfig) -> dict:
    """How the bundle's inputs are made from text, as runtime.yaml records it (the
    tokenizer itself is copied into the bundle as BUNDLE_TOKENIZER)."""
    return {"kind": "text", "tokenizer": BUNDLE_TOKENIZER, "max_length": cfg.max_length, "padding": "none",
            "batch": 1, "fills": dict(FILLED)}


def bundle_encoder(bundle: Path, record: dict, inputs: Sequence[Tuple[str, str]]) -> Encoder:
    """The Encoder a bundle's runtime.yaml text record describes (its tokenizer inside the bundle)."""
    name = str(record.get("tokenizer") or BUNDLE_TOKENIZER)
    if PurePosixPath(name).name != name:
        raise InputError(f"bundle: runtime.yaml names tokenizer {name!r}, not a file of the bundle")
    return Encoder(Path(bundle) / name, record.get("max_length"), inputs, "bundle", "bundle")


def text_argument(argument: str) -> Optional[Texts]:
    """``parity-bundle run``'s INPUT on a text bundle: the texts of an existing file, one
    text given on the command line, or None for a .npy/.npz file (tensors). A name that
    looks like a file (a text suffix or .npy/.npz, no spaces) but does not exist is an
    error, not a text."""
    if not argument.strip():
        raise InputError("--input: the text is empty")
    path = Path(argument).expanduser()
    suffix = path.suffix.lower()
    if path.is_file():
        if suffix in (".npy", ".npz"):
            return None
        texts = read_texts(path, "--input")
        if not texts:
            raise InputError(f"--input: {path} holds no texts (one text a line, blank lines skipped)")
        return texts
    if path.exists():
        raise InputError(f"--input: {path} is not a file")
    if suffix in (*TEXT_SUFFIXES, ".npy", ".npz") and not any(c.isspace() for c in argument):
        raise InputError(f"--input: {path} does not exist (to run it as text, quote a sentence)")
    return [("text", argument)]
