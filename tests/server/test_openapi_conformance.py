"""/openapi.json against behaviour: schemathesis, every check (`--checks all`), against a real
server on loopback, a bounded number of examples, a fixed seed; any failure fails the test, with
schemathesis's report (each failure with the curl command that reproduces it) as the message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.server import make_engine, serve, wait_idle

# Operations whose acceptance of a body that fits the schema also depends on the served model, which
# JSON Schema cannot say: a prompt's tokens plus max_tokens must fit the context, token ids must be
# in the vocabulary, a conversation must render under the chat template. There a 400 for such a
# body is behaviour, not a mismatch; every other check stays on, and every other status is checked.
MODEL_DEPENDENT = ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages",
                   "POST /v1/messages/count_tokens", "POST /v1/responses", "POST /v1/embeddings",
                   "POST /tokenize", "POST /detokenize")
CONFIG = "".join(f'''
[[operations]]
include-name = "{name}"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404", "429"]
''' for name in MODEL_DEPENDENT)


@pytest.mark.slow
def test_schemathesis_finds_no_mismatch_between_the_description_and_the_server(demo_dir: Path,
                                                                              tmp_path: Path) -> None:
    engine = make_engine(demo_dir, max_model_len=32)
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    with serve(engine, served_model_name="demo") as (url, app):
        assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 200
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
             f"{url}/openapi.json", "--checks", "all", "--max-examples", "3", "--seed", "1", "--workers", "1",
             "--generation-database", "none", "--request-timeout", "30"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path)
        print(run.stdout)  # the run's summary (phases, timings), shown with -s
        assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        wait_idle(app, timeout=60)
