//! Plain-text tables as kubectl prints them: left-aligned columns, three
//! spaces apart, no trailing blanks.

/// `rows` (the header first) as aligned lines.
pub fn render<const N: usize>(rows: &[[String; N]]) -> String {
    let widths: Vec<usize> = (0..N)
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    rows.iter()
        .map(|r| {
            let cells: Vec<String> = r
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            cells.join("   ").trim_end().to_string() + "\n"
        })
        .collect()
}
