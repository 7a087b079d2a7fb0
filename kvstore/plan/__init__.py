"""`kvstore plan`: hit ratio, TTFT and $ per million tokens for candidate tier configurations.

Runs in the user's shell process. traces (readers) → model (KV bytes per token) → tiers (replay
through the real store) → cost (TTFT, throughput at the SLA, $/Mtok) → report / plots; validate
checks a prediction against real vLLM engines and a real node agent; progress draws the stderr bar
of the long passes.
"""
