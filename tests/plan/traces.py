"""Synthetic Mooncake-format traces for the planner tests."""

import json
import random


def write_mooncake(path, requests: int = 400, seed: int = 0) -> str:
    """Conversations that extend earlier prompts: prefix-chained ids as in the real trace."""
    rng = random.Random(seed)
    conversations: list[list[int]] = []
    next_id, lines = 0, []
    for number in range(requests):
        if conversations and rng.random() < 0.7:
            ids = list(rng.choice(conversations))
        else:
            ids = [0] if rng.random() < 0.5 else []
            conversations.append(ids)
        for _ in range(rng.randint(1, 6)):
            ids.append(next_id := next_id + 1)
        conversations.append(ids)
        tokens = 512 * (len(ids) - 1) + rng.randint(1, 512)
        lines.append(
            json.dumps(
                {
                    "timestamp": number * 200,
                    "input_length": tokens,
                    "output_length": 10,
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return str(path)
