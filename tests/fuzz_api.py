"""`make fuzz`: schemathesis against /openapi.json of a demo cluster, then a check that it still serves.

Every generated request must get a documented status, content type and body, and never a 5xx; the
cluster must then answer a greedy completion exactly as before the run.

    python tests/fuzz_api.py [--max-time 150] [--seed 1]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_helpers import Cluster, cluster_yaml, post  # noqa: E402

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
GREEDY = {"prompt": "Experts are", "max_tokens": 8, "temperature": 0, "return_token_ids": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-time", type=int, default=150, help="seconds of fuzzing (default 150)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = cluster_yaml(Path(tmp), "demo", name="fuzz", engine={"kv_cache_bytes": "64MiB"})
        with Cluster(path) as c:
            c.start_all()
            c.wait_ready()
            code, before = post(c.url(), "/v1/completions", GREEDY)
            assert code == 200, before
            st = Path(sys.executable).with_name("st")
            run = subprocess.run(
                [
                    str(st),
                    "run",
                    f"{c.url()}/openapi.json",
                    "--checks",
                    CHECKS,
                    "--max-time",
                    str(args.max_time),
                    "--request-timeout",
                    "60",
                    "--seed",
                    str(args.seed),
                    "--workers",
                    "1",
                ]
            )
            code, after = post(c.url(), "/v1/completions", GREEDY)
            same = code == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
            print(
                f"fuzz: schemathesis exit {run.returncode}; after the run the cluster "
                f"{'answers as before' if same else f'answers differently: {code} {after}'}"
            )
            ok = run.returncode == 0 and same
            print(f"fuzz: {int(ok)} passed, {int(not ok)} failed")
            return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
