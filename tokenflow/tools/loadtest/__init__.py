"""Burst load tests with Locust: streaming readers against the OpenAI API.

`shapes` (arrival schedules, reading-rate mixes) and `recorder` (per-request
accounting on tokenflow.core.buffer.ReaderBuffer) are pure Python. `locustfile`
imports Locust, which monkeypatches the process with gevent, so it is only
ever loaded by a `locust` process; `runner` starts that process.
"""
