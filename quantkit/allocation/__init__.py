"""Mixed precision to a budget: measure how much each linear's quantization costs in KL
(`sensitivity`), count what each scheme costs in stored bytes (`budget`), choose one scheme per
linear under a size budget (`knapsack`), and show the table (`report`). See docs/allocation.md."""
