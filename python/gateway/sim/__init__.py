"""Simulation, apart from serving: `gateway mock` (an OpenAI-compatible simulated backend),
`gateway demo` (simulated pools, a judge workload, an injected crash) and its HTML report.

They talk to the gateway only through its public surface: `gateway.server.Server`, HTTP, and
the typed event stream `gateway.events` — never by parsing log text.
"""
