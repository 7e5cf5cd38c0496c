"""`make fuzz`: schemathesis against /openapi.json of a demo cluster, then a check that it still serves.

Every generated request must get a documented status, content type and body, and never a 5xx; the
cluster must then answer a greedy completion exactly as before the run. The run is a fixed number of
cases per operation drawn from a seed (printed first, and again with any failure), with no example
database, so that a seed gives the same requests on any machine at any speed and a failure reproduces:

    python tests/fuzz_api.py [--seed S] [--max-examples 60]
"""

from __future__ import annotations

import argparse
import random
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
    ap.add_argument("--seed", type=int, default=None, help="the run's seed (default: a random one, printed)")
    ap.add_argument("--max-examples", type=int, default=60, help="cases per API operation (default 60)")
    args = ap.parse_args()
    seed = random.SystemRandom().randrange(2**32) if args.seed is None else args.seed
    again = f"python tests/fuzz_api.py --seed {seed} --max-examples {args.max_examples}"
    print(f"fuzz: seed {seed}, {args.max_examples} cases per operation (to rerun: {again})", flush=True)
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
                    "--max-examples",
                    str(args.max_examples),
                    "--seed",
                    str(seed),
                    "--generation-database",
                    "none",
                    "--request-timeout",
                    "60",
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
            print(f"fuzz: {int(ok)} passed, {int(not ok)} failed (seed {seed}{'' if ok else f'; rerun: {again}'})")
            return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
