"""The tool kit behind tools/steps.py: chapters, trees, pages, checks (introduced with chapter 0).

manifest  chapters/chNN_slug/chapter.toml as Chapter objects; the Book that holds them
delta     delta.patch: writing, strictly reading and reverse-applying a chapter's delta
build     writing a tree to a folder; diff, and `record` (re-deriving deltas and digests)
sandbox   running a command inside a materialised tree, isolated from the repository
pages     the Markdown side: fences, includes, the tree block, output markers
outputs   the "运行结果" blocks: running, masking, comparing, regenerating, benchmarks
mutate    mutation experiments (chapters/chNN_slug/mutants.toml)
check     the eight properties
"""
