"""The course: what the notebooks (notebooks/*.ipynb) call that is not the library itself. Nothing
in the library imports it, and it imports only the library (never the programs in apps/).

    notebook.py       setup(), the first call of every notebook (threads, seed, inline figures), and
                      interact(), the "Try it" cells' controls with a still of their first figure
    checks.py         what every exercise check shares: its message's first word, the wrapping
    exercise_NN.py    the exercise at the end of notebook NN: a `check_*` function that says whether
                      an answer is right and, when it is not, *why* -- naming the usual mistake the
                      answer matches -- and the solution (`solution_*`), computed by the same package
                      code the notebook teaches, so that a check can never disagree with the lesson

The exercises:

    01  predict the recompute / cached FLOP ratio of one decode step at a context length
    02  compute one expert's cache size, in bytes, from the router's decisions
    03  choose the largest block size that keeps plain pages at effective utilization >= 0.96
    04  choose max_num_seqs so that optimistic admission never preempts, as fast as possible
    05  write a victim rule: preempt the request that makes the most room on the short device
    06  count the prompt tokens a prefix hit reuses, in whole blocks
    07  place experts on ranks: few ranks touched per token, K/V balanced over the ranks
    08  choose the split size of split-K decode attention that keeps every SM of a GPU busy
    09  the price of routing attention, as a ratio of perplexities
    10  find the smallest row budget at which drop refuses no token of a snippet
    11  count the blocks worst-case reservation sets aside for a prompt on each GPU of a cluster
"""
