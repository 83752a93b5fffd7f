"""``zipage bench ...`` subcommands."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: throughput, serve, chunks, replay, decode, kernels, linear, moe, compression, host, "
                                           "router",
                           description="Benchmarks of the engine, its server and its kernels.")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    from zipage.bench.chunks import add_chunks_parser
    from zipage.bench.compression import add_compression_parser
    from zipage.bench.decode import add_decode_parser
    from zipage.bench.host import add_host_parser
    from zipage.bench.kernels import add_kernel_parser
    from zipage.bench.linear import add_linear_parser
    from zipage.bench.moe import add_moe_parser
    from zipage.bench.replay import add_replay_parser
    from zipage.bench.router_overhead import add_router_parser
    from zipage.bench.serving import add_serving_parser
    from zipage.bench.throughput import add_throughput_parser
    add_decode_parser(kinds)
    add_kernel_parser(kinds)
    add_linear_parser(kinds)
    add_moe_parser(kinds)
    add_compression_parser(kinds)
    add_throughput_parser(kinds)
    add_replay_parser(kinds)
    add_serving_parser(kinds)
    add_chunks_parser(kinds)
    add_host_parser(kinds)
    add_router_parser(kinds)
