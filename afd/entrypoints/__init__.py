"""The top floor: what a user calls. The `afd` command line (cli.py and the commands it gathers: serve, launch,
rebalance, plan, prometheus-config) and `afd.LLM` (llm.py). Nothing else in afd imports from here."""
