"""What the worker (hostlib) and the switch (switchsim) both speak: the wire format, the counter-based
random stream, the NC code table, join authentication and address helpers. Small on purpose: importing
the switch must not load the worker's fast path, and the other way round."""
