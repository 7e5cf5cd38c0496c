"""The streaming-completion readers the tests share live with the benchmark that also uses them."""

from afd.bench.streams import Streams, Ticker, stream_completion, stream_timed

__all__ = ["Streams", "Ticker", "stream_completion", "stream_timed"]
