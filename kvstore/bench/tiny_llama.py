"""Builds a random-weight Llama and a locally trained tokenizer, offline (no model hub), for
the vLLM tests and `kvstore bench vllm`. Runs in the test or benchmark process.

Same arguments give byte-identical files, so a build can be cached per test session.
"""

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
TOKEN_IDS = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}  # configs'
MAX_POSITION_EMBEDDINGS = 8192

_WORD_TEXT = """
the a an one two three cache block token layer model prompt answer server client node store
load save copy read write fast slow small large old new red blue green cold warm river mountain
city garden window kitchen morning evening summer winter teacher student doctor farmer writer
runs walks reads writes builds keeps finds sends holds opens closes quickly slowly quietly often
never always near under over behind before after with without and but because while if then is
was will can may must should
"""
_WORDS = _WORD_TEXT.split()


def corpus_sentences(num_sentences: int = 600, seed: int = 0) -> list[str]:
    """English-looking sentences from a fixed word list; the same seed gives the same text."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_sentences):
        words = rng.choices(_WORDS, k=rng.randint(5, 14))
        sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return sentences


def _train_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly `vocab_size` entries, special tokens first."""
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus_sentences(seed=seed), trainer=trainer)
    if bpe.get_vocab_size() != vocab_size:
        raise ValueError(
            f"corpus too small: tokenizer has {bpe.get_vocab_size()} entries, wanted "
            f"{vocab_size}; lower vocab_size or lengthen the corpus"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )


def build_tiny_llama(
    directory: Path,
    dtype: str = "float32",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    head_dim: int = 32,
    intermediate_size: int | None = None,
) -> Path:
    """Write config, safetensors weights and tokenizer files into `directory`; return it.

    `head_dim` is explicit because vLLM's CPU attention accepts only head sizes
    32, 64, 80, ... (hidden_size / num_heads would be 16 with the defaults).
    `intermediate_size` defaults to 2 × hidden_size.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        **TOKEN_IDS,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    return save_model(directory, LlamaForCausalLM, config, dtype, vocab_size, seed)


def save_model(
    directory: Path, model_class, config, dtype: str, vocab_size: int, seed: int
) -> Path:
    """Write a `model_class` of `config` with weights drawn from `seed`, and this module's
    tokenizer of `vocab_size` entries, into `directory`; return it."""
    torch.manual_seed(seed)
    model = model_class(config).to(getattr(torch, dtype)).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _train_tokenizer(vocab_size, seed).save_pretrained(directory)
    return directory
