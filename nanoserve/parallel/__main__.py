"""`python -m nanoserve.parallel`: one tensor-parallel worker rank, as `WorkerRanks.start` runs it."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from nanoserve.engine.args import EngineArgs
from nanoserve.log import configure_logging
from nanoserve.parallel.group import Rendezvous
from nanoserve.parallel.worker import run_worker

log = logging.getLogger("nanoserve.parallel.worker")


def main() -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel worker rank (started by nanoserve)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--engine-args", required=True, help="EngineArgs as a JSON object")
    ns = parser.parse_args()
    # Like the engine core: a terminal's Ctrl-C reaches the whole process group, and rank 0, which
    # lets requests in flight finish first, ends the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(ns.log_level)
    args = EngineArgs(**json.loads(ns.engine_args))
    try:
        run_worker(args, Rendezvous(ns.master_addr, ns.master_port, args.tensor_parallel_size), ns.rank)
    except Exception:
        log.exception("tensor-parallel rank %d failed", ns.rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
