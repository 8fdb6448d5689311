"""The server's defaults that `nanoserve serve --help` shows: a module free of torch and of the
app's imports, so the CLI's parser can read them without loading the server."""

DEMO_MODEL_NAME = "nanoserve-demo"
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_PROMPT_WORKERS = 2
DEFAULT_KEEP_ALIVE_S = 15.0  # a stream silent this long gets a `: keep-alive` comment
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a larger request body is refused with a 413 before it is parsed
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a connection gets this long to send a whole request head (slowloris)
DEFAULT_IDLE_TIMEOUT_S = 5  # an idle keep-alive connection is closed after this long
DEFAULT_MAX_CONNECTIONS = 1024  # open connections beyond which a new one is answered with a 503
