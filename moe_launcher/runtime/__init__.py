"""Runtime pieces every patch and tool shares: collectives, version checks, refusals, durable
files."""
