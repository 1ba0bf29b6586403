"""The text the tiny checkpoint's tokenizer is trained on.

It ships as a Python string (not a data file) so it travels with the package
into every image without package-data configuration. The words are about the
project itself, so a tokenizer trained on them splits its own docs sensibly.
"""

CORPUS = """\
kubellm runs fleets of language models on Kubernetes. A model owner applies an
LLMDeployment and gets one endpoint that speaks the OpenAI API. Behind it, a
gateway routes each request to a replica of the vLLM engine.

Serving a language model has two phases. Prefill reads the whole prompt at once
and fills the key and value cache; it decides the time to first token. Decode
writes one token per step for every running request; each step reads all of the
weights from memory, so memory bandwidth decides the inter-token latency.

Every running request keeps its keys and values in a pool of cache blocks. The
pool is what is left of the accelerator memory after the weights. When the pool
is full, new requests wait in a queue, and the engine may preempt a running
request to make room. That is why the autoscaler watches the cache usage and the
queue depth, not the processor load.

Requests that share a prompt prefix can share cache blocks. The engine hashes
every full block of tokens together with the hash of the block before it, and a
later request that starts with the same tokens finds those blocks and skips
their prefill. The gateway sends such requests to the replica that already holds
the prefix, unless that replica is much busier than the others.

When every replica is busy, or none is ready yet, the gateway can send the
overflow to an external API instead of letting the queue grow. Goodput counts the
requests per second that meet both the time to first token target and the
inter-token latency target; it is the number that routing and scaling try to
raise.

The engine batches requests continuously. At each step the scheduler gives a
token budget to the running requests first, one token each for decoding, and
then to waiting prompts, in chunks when a prompt is longer than what is left of
the budget. A bus that carries thirty passengers costs about as much to drive as
a bus that carries one; batching is how one replica serves many users at once.

Hello! How can I help you today? The cluster is healthy. The model is ready.
The quick brown fox jumps over the lazy dog. One, two, three, four, five, six,
seven, eight, nine, ten. Questions and answers, users and assistants, systems
and prompts, tokens and blocks, replicas and requests.
"""
