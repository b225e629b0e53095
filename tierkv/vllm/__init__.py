"""tierkv inside vLLM 0.33: an OffloadingSpec backed by a tierkv node, and tierkv's policies as vLLM cache policies."""  # noqa: E501
