"""How sync ranks combine gradients: :mod:`.reducer` (the bucketed all-reduce overlapping the
backward pass) and :mod:`.host_sum` (the sum through host memory when every rank is on one host,
used by sync torch and by ``ctx.prepare``)."""
