//! ESP's budget arithmetic, written once: a block of `(k + 1)(1 + nodes)` rows holds the root and `nodes`
//! draft tokens, each with its k mask rows.

/// Block complexity of ESP: every token in the forward, masks included: `(k + 1) * (1 + sum K_i)`.
pub fn block_complexity(k: usize, branches: &[usize]) -> usize {
    rows_for(k, branches.iter().sum())
}

/// Largest block complexity `--bc` takes: rows per forward pass, far above any useful setting.
pub const MAX_BC: usize = 1024;

/// Node budget (`sum K_i`) for a block complexity: `BC / (k + 1) - 1` (rounded down). The smallest useful BC
/// is `2 (k + 1)`: the root and one draft node, each with its k masks.
pub fn node_budget(bc: usize, k: usize) -> Result<usize, String> {
    let min = 2 * (k + 1);
    if bc < min {
        return Err(format!(
            "--bc {bc} is too small for --masks {k}: needs at least {min} \
             (the root and one draft token, each with {k} mask(s))"
        ));
    }
    if bc > MAX_BC {
        return Err(format!("--bc {bc} is too large: it must be in {min}..={MAX_BC}"));
    }
    Ok(nodes_within(bc, k))
}

/// Rows of a block with `nodes` draft tokens and k masks on every node (the root included).
pub fn rows_for(k: usize, nodes: usize) -> usize {
    (k + 1) * (1 + nodes)
}

/// Most draft nodes (k masks each) that fit in `rows` rows with the root and its masks; 0 when not even
/// the root's do.
pub fn nodes_within(rows: usize, k: usize) -> usize {
    (rows / (k + 1)).saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_arithmetic() {
        assert_eq!(block_complexity(1, &[4]), 10);
        assert_eq!(block_complexity(1, &[14]), 30);
        assert_eq!(block_complexity(2, &[15, 4]), 60);
        assert_eq!(block_complexity(1, &[29]), 60);
        assert_eq!(node_budget(30, 1), Ok(14));
        assert_eq!(node_budget(60, 2), Ok(19));
        assert_eq!(node_budget(10, 1), Ok(4));
        assert_eq!(node_budget(4, 1), Ok(1));
        let err = node_budget(3, 1).unwrap_err();
        assert!(
            err.contains("--bc 3 is too small for --masks 1: needs at least 4"),
            "{err}"
        );
        assert!(node_budget(5, 2).is_err());
        assert_eq!(node_budget(6, 2), Ok(1));
    }

    #[test]
    fn rows_and_nodes_invert() {
        for k in 1..=3 {
            for nodes in 0..40 {
                assert_eq!(nodes_within(rows_for(k, nodes), k), nodes);
                assert_eq!(nodes_within(rows_for(k, nodes) + k, k), nodes);
            }
        }
        assert_eq!(nodes_within(1, 1), 0);
    }
}
