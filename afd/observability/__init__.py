"""Prometheus metrics, scrape config and the timers behind them."""
