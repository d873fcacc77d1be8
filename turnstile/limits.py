"""Every default limit and timeout, named, with the reason for its value.

Settings (`turnstile.settings`) take their defaults from here; nothing in Turnstile
relies on a library's own default timeout.
"""

from __future__ import annotations

# --- backend timeouts -------------------------------------------------------------
# Opening a TCP connection to a backend on the same host or rack takes milliseconds;
# ten seconds covers a busy accept queue without hiding a dead backend for long.
CONNECT_TIMEOUT_S = 10.0
# Until the first byte of a response: a non-streaming call answers only when the whole
# generation is done, and a loaded vLLM may queue a request behind a full batch, so
# long agent generations (tens of thousands of tokens) need many minutes.
FIRST_BYTE_TIMEOUT_S = 900.0
# Between two chunks of a stream: a healthy engine emits tokens every few ms; a
# minute of silence means a stuck engine or a dead connection.
IDLE_TIMEOUT_S = 120.0
# The whole call, as a last resort against a stream that trickles forever.
TOTAL_TIMEOUT_S = 3600.0
# Bodies of passthrough and error responses are read whole; bound them.
MAX_PASSTHROUGH_BODY_BYTES = 64 * 1024 * 1024

# --- files ---------------------------------------------------------------------------
# Shards, manifests and journal segments hold every prompt and completion: readable and
# writable by their owner only. A trainer running as another user is given access by the
# operator (a shared group and `chmod g+r`, or an ACL), never by default.
OUTPUT_FILE_MODE = 0o600

# --- client side ---------------------------------------------------------------------
# Long agent contexts (128k tokens of text, base64 images) stay well under 32 MiB; a
# screenshot agent's call with a dozen 1-2 MB PNGs (base64: 4/3 of that) too. A rollout
# with more images sends them across calls; each is journaled once per rollout.
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# One image, decoded (OpenAI's own per-image limit): checked before it is hashed.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# Bodies being read at once, all requests together: eight of the largest. A ninth waits
# for none of them: it gets 503 with Retry-After (slow clients cannot pin the memory).
MAX_BUFFERED_BODY_BYTES = 8 * MAX_REQUEST_BODY_BYTES
# Reading one body: 32 MiB over a 10 Mbit/s link takes 27 s; a client slower than that is
# holding a connection open (slowloris), and gets 408.
REQUEST_BODY_READ_TIMEOUT_S = 60.0
# Request headers: real clients send a few dozen headers in a few KiB (nginx allows 32 KiB
# by default); more is refused with 431 before anything else runs.
MAX_REQUEST_HEADERS = 100
MAX_REQUEST_HEADER_BYTES = 64 * 1024
# A request's line and headers, from the moment its connection opens or its previous
# response ends: clients send them in one write, in milliseconds. A client still sending
# them after 20 s (Apache's mod_reqtimeout starts at 20 s too) is holding the connection
# open (slowloris): it gets 408 and is closed; a connection that sends nothing is closed.
HEADER_READ_TIMEOUT_S = 20.0
# The request line and headers as received, bounded while they are read (431): twice the
# header bytes checked above, room for a long URL and the framing, so that a client cannot
# grow uvicorn's buffers without end before the app sees the request.
MAX_REQUEST_HEAD_BYTES = 2 * MAX_REQUEST_HEADER_BYTES
# Rollout ids appear in URLs and file rows; keep them short and URL-safe.
MAX_ROLLOUT_ID_LENGTH = 128
# Token ids are int32 columns and never negative; a backend id outside is refused.
MAX_TOKEN_ID = 2**31 - 1
# Choice indices: far above any real `n`, and the bound keeps one call's choices finite.
MAX_CHOICE_INDEX = 16383
# orjson writes JSON nested at most this deep; a request deeper cannot be recorded (its
# messages and tools are JSON columns), so it is refused with 422 before it is forwarded.
MAX_JSON_DEPTH = 255
# Policy versions are int64 columns: anything outside is refused where it enters.
MIN_POLICY_VERSION = -(2**63)
MAX_POLICY_VERSION = 2**63 - 1

# --- backend connection pool -----------------------------------------------------------
# One keep-alive connection per concurrent stream; rollout fleets run hundreds.
BACKEND_POOL_SIZE = 1024

# --- recording ----------------------------------------------------------------------
# Turns waiting for the writer thread. At ~50 KB a turn this is ~400 MB at worst;
# beyond it the writer is hopelessly behind and clients get 503 instead of data loss.
RECORDER_QUEUE_SIZE = 8192
# Image bytes in turns waiting for the writer: a screenshot turn carries MBs, so the queue's
# item count alone does not bound its memory; past this new calls get 503.
MAX_RECORDER_MEDIA_BYTES = 1024 * 1024 * 1024
# A shard per this many rows keeps files large enough for efficient scans.
SHARD_MAX_ROWS = 4096
# ...and no row waits longer than this to become visible to a trainer.
SHARD_MAX_AGE_S = 30.0
# A sealed rollout (one without a group, or the last of its group) is published at most
# this long after it is sealed: a synchronous trainer waiting for a batch gets it within
# a second. Seals within the window share one shard per table, so prompt publication
# makes at most 2 shards per table and second, however many rollouts finish.
PUBLISH_DELAY_S = 0.5
# POST /admin/flush waits this long for the writer to publish what it was handed.
ADMIN_FLUSH_TIMEOUT_S = 60.0
# A GRPO group is a handful to a few hundred rollouts; a larger declared size is a typo.
MAX_GROUP_SIZE = 65_536
# How often the writer thread wakes to roll aged shards when idle.
WRITER_TICK_S = 1.0

# How often journal segments whose frames are all published are looked for and removed.
# A 64 MiB segment fills in seconds at full load; looking every few seconds keeps the
# journal within a few segments of what is unpublished, for a stat() per segment.
JOURNAL_RETENTION_INTERVAL_S = 5.0

# --- rollouts ----------------------------------------------------------------------------
# An agent may think, run tools or wait on a sandbox for minutes between turns;
# half an hour without a turn means the harness has gone away.
ROLLOUT_IDLE_TIMEOUT_S = 1800.0
# How often idle rollouts are looked for.
ROLLOUT_SWEEP_INTERVAL_S = 5.0

# Turns are kept in memory until their rollout is sealed and stitched. A 128k-token
# agent rollout of 100 turns holds ~100 MB of token arrays and messages; refusing new
# turns past 512 MiB (409: finish the rollout) stops one runaway rollout from taking
# the host down.
MAX_ROLLOUT_BYTES = 512 * 1024 * 1024
# All open rollouts together: past 4 GiB new turns get 503 with Retry-After until
# rollouts are finished, instead of the proxy growing until the OOM killer ends it.
MAX_OPEN_ROLLOUT_BYTES = 4 * 1024 * 1024 * 1024

# --- shutdown --------------------------------------------------------------------------
# In-flight streams get this long to finish on SIGTERM before they are cut.
DRAIN_TIMEOUT_S = 30.0
# The writer thread gets this long to publish everything on shutdown.
WRITER_JOIN_TIMEOUT_S = 120.0
