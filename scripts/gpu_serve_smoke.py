"""The demo model served on a CUDA GPU (`nanoserve serve --device cuda`): one plain and one streamed
chat through httpx. Part of scripts/gpu_checklist.sh; exits non-zero when the server dies or a
request fails."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx

URL = "http://127.0.0.1:8123"


def main() -> int:
    cmd = [sys.executable, "-c", "import sys; from nanoserve.cli import main; sys.exit(main())",
           "serve", "--device", "cuda", "--port", "8123"]
    server = subprocess.Popen(cmd)
    try:
        while server.poll() is None:
            try:
                if httpx.get(f"{URL}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        if server.poll() is not None:
            print(f"the server exited with {server.returncode}")
            return 1
        body = {"model": "nanoserve-demo", "messages": [{"role": "user", "content": "Tell me a story."}],
                "max_tokens": 32, "temperature": 0}
        reply = httpx.post(f"{URL}/v1/chat/completions", json=body, timeout=60)
        print(reply.status_code, json.dumps(reply.json())[:600])
        with httpx.stream("POST", f"{URL}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: ")]
        print(len(chunks), "SSE chunks, last:", chunks[-1] if chunks else None)
        return 0 if reply.status_code == 200 and chunks and chunks[-1] == "data: [DONE]" else 1
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
