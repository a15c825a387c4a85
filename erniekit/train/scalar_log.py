"""Training scalars: VisualDL plus a JSON-lines copy, and dropping what an interrupted run logged
past the checkpoint it resumes from (those steps are trained and logged again)."""

from __future__ import annotations

import json
import os

JSONL_NAME = "scalars.jsonl"


class ScalarLogger:
    """VisualDL scalars plus a JSON-lines copy (easy to read in tests and tools).

    The VisualDL writer opens on first use, so that a resumed run can first drop what the
    interrupted run logged past its checkpoint (`drop_after`): those steps are trained again."""

    def __init__(self, logdir: str, enabled: bool = True):
        self.enabled = enabled
        self.logdir = logdir
        self._writer = None
        self.jsonl = None
        if enabled:
            os.makedirs(logdir, exist_ok=True)
            self.jsonl = open(os.path.join(logdir, JSONL_NAME), "a", encoding="utf-8")

    @property
    def writer(self):
        if self._writer is None and self.enabled:
            from visualdl import LogWriter

            self._writer = LogWriter(logdir=self.logdir)
        return self._writer

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        for k, v in values.items():
            self.writer.add_scalar(tag=k, value=float(v), step=step)
        self.jsonl.write(json.dumps({"step": step, **{k: float(v) for k, v in values.items()}}) + "\n")
        self.jsonl.flush()

    def drop_after(self, step: int) -> int:
        """Remove every record past `step` from the VisualDL files and scalars.jsonl (a resumed
        run logs those steps again); returns how many records went. Each file is rewritten beside
        itself and renamed over the old one, so a crash here keeps the old file whole."""
        if not self.enabled:
            return 0
        if self._writer is not None:
            raise RuntimeError("drop_after must run before the first record of this run is written")
        self.jsonl.close()
        dropped = drop_jsonl_after(os.path.join(self.logdir, JSONL_NAME), step)
        self.jsonl = open(os.path.join(self.logdir, JSONL_NAME), "a", encoding="utf-8")
        for name in sorted(os.listdir(self.logdir)):
            if "vdlrecords" in name and not name.endswith(".tmp"):
                dropped += drop_vdl_after(os.path.join(self.logdir, name), step)
        return dropped

    def flush(self) -> None:
        """The VisualDL writer keeps records in memory up to 120 s; a checkpoint flushes them."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.jsonl is not None:
            self.jsonl.close()


def drop_jsonl_after(path: str, step: int) -> int:
    """Keep the lines of a scalars.jsonl at or before `step` (a torn last line goes too)."""
    if not os.path.isfile(path):
        return 0
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if row_step <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        _replace_file(path, "".join(kept).encode("utf-8"))
    return dropped


def drop_vdl_after(path: str, step: int) -> int:
    """Keep the values of a VisualDL record file (uint64 length + a `Record` protobuf, repeated)
    whose step (`id`) is at or before `step`; a torn last record goes too."""
    import struct

    from visualdl.proto import record_pb2

    data = open(path, "rb").read()
    out, pos, dropped = bytearray(), 0, 0
    while pos + 8 <= len(data):
        (n,) = struct.unpack("<Q", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        pos += 8 + n
        if len(body) < n:
            dropped += 1
            break
        rec = record_pb2.Record()
        rec.ParseFromString(body)
        keep = [v for v in rec.values if v.id <= step]
        dropped += len(rec.values) - len(keep)
        if len(keep) == len(rec.values):
            out += data[pos - 8 - n : pos]
        elif keep:
            new = record_pb2.Record()
            new.values.extend(keep)
            b = new.SerializeToString()
            out += struct.pack("<Q", len(b)) + b
    if pos < len(data):
        dropped += 1  # a torn header
    if dropped:
        _replace_file(path, bytes(out))
    return dropped


def _replace_file(path: str, content: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
