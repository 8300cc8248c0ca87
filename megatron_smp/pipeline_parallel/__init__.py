"""Pipeline parallelism: stage layout (`stages`), point-to-point exchange between stages
(`p2p`), the microbatch schedules (`schedules`) and a per-rank Chrome trace (`timeline`)."""
