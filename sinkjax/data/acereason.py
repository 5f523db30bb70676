"""The paper's fine-tuning corpus as sinkjax SFT JSONL: `python -m sinkjax.data.acereason --source IN --out OUT.jsonl`.

[Sink-MoE] §5.3 fine-tunes on "the AceReason-Nemotron dataset (Liu et al., 2025)", the AceReason-Nemotron 1.1 paper,
whose SFT data NVIDIA publishes on the Hugging Face hub as `nvidia/AceReason-1.1-SFT` (math and code; parquet / JSONL
records of `category` ("math" | "code"), `source`, `input` (the problem) and `output` (the response: its reasoning in
<think> ... </think>, then the answer)). That record layout is what this converter reads; it is written from the
dataset's card as we know it (and a derivative's, tkdrnjs0621/AcReason-1.1-short), not from a file fetched here: a
record without `input` / `output` strings is refused with its file and line or row.

    hf download nvidia/AceReason-1.1-SFT --repo-type dataset --local-dir data/acereason
    python -m sinkjax.data.acereason --source 'data/acereason/**/*.parquet' --out data/acereason.jsonl [--category math]

Each record becomes one line {"messages": [{"role": "user", "content": input}, {"role": "assistant", "content":
output}]} (sinkjax.data.sft: the loss on the assistant turn, rendered with the model's chat template, which for Qwen3
keeps the <think> block of the last turn). `--category` keeps one category (the paper does not say which it used:
our choice is all), `--limit N` the first N records; IN may be local or gs://, OUT too.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import tempfile

from sinkjax import options, paths
from sinkjax.config import declare
from sinkjax.data.sources import DataError, expand_files

FIELDS = ("input", "output")


def read_records(pattern: str):
  """(where, record) of every record of the .jsonl / .parquet files matching `pattern`, in file and row order."""
  files = expand_files(pattern, "--source")
  for f in files:
    if f.endswith(".parquet"):
      import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
      with paths.as_path(f).open("rb") as fh:
        pf = pq.ParquetFile(fh)
        missing = [c for c in FIELDS if c not in pf.schema_arrow.names]
        if missing:
          raise DataError(f"{f} has no column {missing[0]!r} (has: {', '.join(pf.schema_arrow.names)}); "
                          "AceReason-1.1-SFT records have input and output")
        cols = [c for c in ("category", *FIELDS) if c in pf.schema_arrow.names]
        row = 0
        for batch in pf.iter_batches(columns=cols, batch_size=1024):
          for rec in batch.to_pylist():
            yield f"{f} row {row}", rec
            row += 1
    elif f.endswith(".jsonl"):
      with paths.as_path(f).open("r", encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
          if line.strip():
            try:
              yield f"{f}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
              raise DataError(f"{f}:{n} is not valid JSON ({e.msg})") from None
    else:
      raise DataError(f"--source matched {f}, which is not .jsonl or .parquet")


def to_messages(rec, where: str) -> dict:
  """One AceReason-1.1-SFT record as a sinkjax SFT example."""
  if not isinstance(rec, dict) or not all(isinstance(rec.get(k), str) for k in FIELDS):
    have = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
    raise DataError(f"{where}: an AceReason-1.1-SFT record needs 'input' and 'output' strings (has: {have})")
  return {"messages": [{"role": "user", "content": rec["input"]}, {"role": "assistant", "content": rec["output"]}]}


def convert(source: str, out: str, category: str | None = None, limit: int | None = None) -> dict:
  """Writes OUT (JSONL); returns {"read", "written"} (records seen, records written)."""
  read = written = 0
  with tempfile.TemporaryDirectory(prefix="sinkjax-acereason-") as tmp:
    local = pathlib.Path(tmp) / "out.jsonl" if paths.is_remote(out) else pathlib.Path(out)
    local.parent.mkdir(parents=True, exist_ok=True)
    with open(local, "w", encoding="utf-8") as fh:
      for where, rec in read_records(source):
        if limit is not None and written >= limit:
          break
        read += 1
        if category is not None and isinstance(rec, dict) and rec.get("category") != category:
          continue
        fh.write(json.dumps(to_messages(rec, where), ensure_ascii=False) + "\n")
        written += 1
    if paths.is_remote(out):
      paths.copy_file(str(local), out)
  if not written:
    raise DataError(f"--source {source!r} gave no example" + (f" of category {category!r}" if category else ""))
  return {"read": read, "written": written}


@dataclasses.dataclass
class AceReasonOptions:
  """The acereason.* options (`python -m sinkjax.data.acereason`; each flag the alias of its key)."""
  source: str = declare("", alias="--source", metavar="IN", required=True,
                    help="path / glob of the dataset's .parquet or .jsonl files")
  out: str = declare("", alias="--out", metavar="OUT", required=True, help="the JSONL to write (local or gs://)")
  category: str | None = declare(None, choices=("math", "code"), alias="--category",
                             help="keep only this category (default: all)")
  limit: int | None = declare(None, ">=1", alias="--limit", metavar="N", help="write at most N examples")


COMMAND = options.Command(
    prog="python -m sinkjax.data.acereason", sections={"acereason": AceReasonOptions},
    description="Convert nvidia/AceReason-1.1-SFT records (input, output; parquet or JSONL) into sinkjax's SFT JSONL "
                "(messages: user, assistant).")


def main(argv=None) -> int:
  def convert_and_print(sections, _) -> int:
    opts = sections["acereason"]
    n = convert(opts.source, opts.out, opts.category, opts.limit)
    print(f"sinkjax.data.acereason: {n['written']:,} example(s) of {n['read']:,} record(s) read -> {opts.out}")
    return 0
  return options.main(COMMAND, argv, convert_and_print)


if __name__ == "__main__":
  sys.exit(main())
