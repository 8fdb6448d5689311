"""Health latency while a server meets hostile input (issue #28): prints one JSON line per attack.

Usage: PYTHONPATH=TREE python scripts/bench_hostile_input.py [--tree TREE] [--port 18300] [--spin]

Serves a copy of the demo model whose chat template builds `'x' * 10**7` for the message "big" and
(with --spin) runs 10**10 empty loop turns for "spin", with `nanoserve serve` from TREE (default: this
checkout), then for each attack polls /health every 50 ms until the attack's answer comes and prints
the answer's status, the seconds it took and the slowest /health. Run it on two trees to compare
(the spin attack never ends on a tree that renders templates on the server's own interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from served import wait_healthy

TEMPLATE = (
    "{%- if messages[-1].content == 'big' %}{{ 'x' * 10**7 }}{% endif -%}"
    "{%- if messages[-1].content == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def attack(url: str, tree: str, name: str, path: str, body: dict[str, Any]) -> None:
    done, result = threading.Event(), {}

    def run() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{url}{path}", json=body, timeout=600)
        result.update(status=r.status_code, seconds=time.monotonic() - t0)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    latencies = []
    while not done.is_set():
        t = time.monotonic()
        httpx.get(f"{url}/health", timeout=600)
        latencies.append(time.monotonic() - t)
        time.sleep(0.05)
    print(json.dumps({"tree": tree, "attack": name, "status": result["status"],
                      "seconds_to_answer": round(result["seconds"], 2), "health_max_s": round(max(latencies), 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--spin", action="store_true", help="also send the template that never ends")
    ns = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": ns.tree}
    demo = subprocess.run([sys.executable, "-c", "from nanoserve.model.demo import demo_model_path; "
                           "print(demo_model_path())"], env=env, capture_output=True, text=True, check=True)
    model = Path(tempfile.mkdtemp()) / "model"
    shutil.copytree(demo.stdout.strip(), model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    url = f"http://127.0.0.1:{ns.port}"
    server = subprocess.Popen([sys.executable, "-m", "nanoserve.cli", "--log-level", "WARNING", "serve", str(model),
                               "--port", str(ns.port), "--max-model-len", "2048"], env=env, cwd=ns.tree)
    try:
        wait_healthy(url, server)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        attack(url, ns.tree, "5 MB prompt", "/v1/completions", {"prompt": "lorem ipsum " * 420_000, "max_tokens": 1})
        attack(url, ns.tree, "template 'x' * 10**7", "/v1/chat/completions",
               {**chat, "messages": [{"role": "user", "content": "big"}]})
        if ns.spin:
            attack(url, ns.tree, "template of 10**10 loop turns", "/v1/chat/completions",
                   {**chat, "messages": [{"role": "user", "content": "spin"}]})
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
