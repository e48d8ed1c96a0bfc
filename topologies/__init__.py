"""Topologies: hosts as network namespaces on links with a rate and loss, a switch of any backend on the
switch host, and an allreduce run across them (`switchsim topo run`). The building block is
switchsim.netns.Star."""
