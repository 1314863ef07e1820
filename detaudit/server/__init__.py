"""Server engines: audit an OpenAI-compatible inference server (`--engine openai`) or a vLLM OpenAI
server that detaudit starts itself (`--engine vllm-server`).

For a server the batch axis is load: a cell's batch size is the number of audited requests in flight,
`--background-load N` adds N concurrent requests of other prompts for the whole time the audited ones
run, and `--repeats R` sends every prompt R times. Results are ordinary cell files.

Layer contract: nothing here imports vLLM, nor `detaudit.builtin` internals; `detaudit.engines`
imports these modules lazily.

- `urls.py`: base URL checks and its credential-free form
- `http.py`: the async HTTP layer (bounded retries with backoff, timeouts, one-line errors)
- `wire.py`: request bodies and response parsing (completions / chat, logprobs -> `Generation`)
- `client.py`: `OpenAIEngine` (the Engine: probe, generate under load, teacher forcing, describe)
- `load.py`: background-load requests
- `launch.py`: `VllmServer` (start vLLM's OpenAI server for a (backend, TP), health wait, teardown)
- `hooks.py`: what the sweep asks of a server engine (engine options, run identity)
"""
