"""Processes: the HTTP server and its front-door limits, `--workers`, supervision, `engine
--disaggregate`."""
