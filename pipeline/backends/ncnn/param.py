"""The ncnn param file (layers, blobs, layer parameters) read and written as text."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from pipeline.backends.ncnn.common import BIN_FILE, FEATMASK_PARAM, _ALIAS_LAYERS


class ParamLayer:
    """One layer line of an ncnn param file: type, name, bottoms, tops and k=v tokens."""

    def __init__(self, line: str):
        tokens = line.split()
        self.type, self.name = tokens[0], tokens[1]
        bottoms, tops = int(tokens[2]), int(tokens[3])
        self.bottoms = tokens[4:4 + bottoms]
        self.tops = tokens[4 + bottoms:4 + bottoms + tops]
        self.params = tokens[4 + bottoms + tops:]

    def param(self, key: int) -> Optional[str]:
        for token in self.params:
            k, _, v = token.partition("=")
            if k == str(key):
                return v
        return None

    def set_param(self, key: int, value: Optional[int]) -> None:
        self.params = [t for t in self.params if t.partition("=")[0] != str(key)]
        if value is not None:
            self.params.append(f"{key}={value}")

    @property
    def featmask(self) -> int:
        value = self.param(FEATMASK_PARAM)
        return int(value) if value else 0

    def line(self) -> str:
        head = f"{self.type:<24} {self.name:<24} {len(self.bottoms)} {len(self.tops)}"
        return " ".join([head, *self.bottoms, *self.tops, *self.params])


class Param:
    """An ncnn text param file (magic, counts, one line per layer)."""

    def __init__(self, text: str):
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines or lines[0].strip() != "7767517":
            raise ValueError("not an ncnn param file (magic 7767517 missing)")
        self.layers = [ParamLayer(line) for line in lines[2:]]
        self.blob_count = int(lines[1].split()[1])
        self._producers: Optional[Dict[str, ParamLayer]] = None

    @classmethod
    def read(cls, path: Path) -> "Param":
        return cls(Path(path).read_text())

    def write(self, path: Path) -> None:
        body = "\n".join(layer.line() for layer in self.layers)
        Path(path).write_text(f"7767517\n{len(self.layers)} {self.blob_count}\n{body}\n")

    def producers(self) -> Dict[str, ParamLayer]:
        if self._producers is None:
            self._producers = {top: layer for layer in self.layers for top in layer.tops}
        return self._producers

    def source(self, blob: str) -> str:
        """The blob a Split output copies (followed through chains of Splits)."""
        producers = self.producers()
        while blob in producers and producers[blob].type in _ALIAS_LAYERS:
            blob = producers[blob].bottoms[0]
        return blob

    def dynamic_blobs(self) -> List[str]:
        """Blobs that depend on an Input, in layer order (constants left out)."""
        dynamic: List[str] = []
        seen = set()
        for layer in self.layers:
            if layer.type == "Input" or any(b in seen for b in layer.bottoms):
                for top in layer.tops:
                    seen.add(top)
                    dynamic.append(top)
        return dynamic


def _bin_name(param_name: str) -> str:
    return param_name[: -len(".param")] + ".bin" if param_name.endswith(".param") else BIN_FILE
