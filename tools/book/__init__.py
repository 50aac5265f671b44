"""The tool kit behind tools/steps.py: chapters, trees, pages, checks (introduced with chapter 0).

manifest  chapters/chNN_slug/tree.toml as Chapter objects; the Book that holds them
build     writing a tree to a folder; diff, rehash and freeze
sandbox   running a command inside a materialised tree, isolated from the repository
pages     the Markdown side: fences, includes, the tree block, output markers
outputs   the "运行结果" blocks: running, masking, comparing, regenerating, benchmarks
mutate    mutation experiments (chapters/chNN_slug/mutants.toml)
check     the eight properties
"""
