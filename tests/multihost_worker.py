"""A stand-in program for launch/local.sh tests: `launch/local.sh ... --module multihost_worker -- MODE [DIR]`.

Modes:
  vote    joins the job (sinkjax.distributed), then two StopVotes: process 1 alone votes SIGTERM, then nobody votes;
          prints what every process reads and its devices
  fail    process 1 exits with status 3 at once; the others hang, ignoring SIGTERM (the launcher must kill them)
  term    waits for SIGTERM, then prints that it got it and exits 143
  orphan  joins the job, prints "ready", waits; on SIGTERM (the launcher-watch's) it writes DIR/stopped_I and exits
  gloo    prints gloo's connection report as it reaches a pipe from two threads (cut and mixed, a lone "1" after it),
          then its own lines, a number alone among them
"""
import os
import pathlib
import signal
import sys
import time


def main(mode: str, out_dir: str | None = None) -> int:
  pid = int(os.environ["SINKJAX_PROCESS_ID"])
  if mode == "fail":
    if pid == 1:
      return 3
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
      time.sleep(1)
  if mode == "gloo":
    report = "[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks is : "
    print(report.format(pid) + report.format(1 - pid) + "1")
    print("1")
    print(report.format(pid) + "1")
    print("peer ranks. Expected number of connected peer ranks is : 1")
    print(f"process {pid} is here")
    print("1")
    print("connected to 2 of 2", flush=True)
    return 0
  if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print(f"process {pid} got SIGTERM", flush=True), sys.exit(143)))
    print("ready", flush=True)
    while True:
      time.sleep(0.1)
  from sinkjax import distributed, sharding
  from sinkjax.config import MeshConfig
  assert distributed.maybe_initialize()
  import jax
  if mode == "vote":
    vote = distributed.StopVote(sharding.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)))
    first = vote.result(vote.cast(signal.SIGTERM if pid == 1 else None))
    second = vote.result(vote.cast(None))
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices of "
          f"{jax.device_count()}, votes {first} {second}", flush=True)
    return 0
  assert mode == "orphan", mode

  def stopped(*_):
    pathlib.Path(out_dir, f"stopped_{pid}").write_text(str(os.getpid()))
    os._exit(0)   # pylint: disable=protected-access
  signal.signal(signal.SIGTERM, stopped)
  print("ready", flush=True)
  while True:
    time.sleep(0.1)


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
