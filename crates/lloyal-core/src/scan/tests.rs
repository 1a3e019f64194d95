use super::*;

/// log(sum(exp(s x))) in f64, NaN skipped.
fn reference_lse(values: &[f32], s: f64) -> f64 {
    let xs: Vec<f64> = values.iter().filter(|x| !x.is_nan()).map(|&x| f64::from(x) * s).collect();
    let m = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

fn row(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 100_000) as f32 / 2500.0 - 20.0
        })
        .collect()
}

fn all_kernels() -> Vec<(&'static str, Kernels)> {
    let mut out = vec![("portable", portable::KERNELS)];
    #[cfg(target_arch = "x86_64")]
    out.extend(x86::every());
    out
}

#[test]
fn every_kernel_matches_the_f64_reference_at_sizes_around_each_width() {
    for &n in &[1usize, 5, 31, 32, 63, 64, 65, 4095, 4096, 4097, 10_000, 262_144] {
        let mut values = row(n, n as u64);
        if n > 40 {
            values[7] = f32::NEG_INFINITY;
            values[n / 2] = f32::NAN;
            values[n - 3] = 25.0; // the maximum, twice: the first position wins
            values[n - 2] = 25.0;
        }
        for (name, k) in all_kernels() {
            // 4: scaled exponents far below the smallest normal float.
            for scale in [None, Some(1.25f32), Some(0.5), Some(4.0)] {
                let (mut copy, mut maxima) = (Vec::new(), Vec::new());
                let stats = scan_with(k, &values, Some(&mut copy), &mut maxima, scale);
                assert_eq!(copy.len(), n);
                assert!(copy.iter().zip(&values).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} copy");
                for (s, m) in maxima.iter().enumerate() {
                    let span = &values[s * SPAN..((s + 1) * SPAN).min(n)];
                    assert_eq!(*m, span.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{name} span {s}");
                }
                let want_max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert_eq!(stats.max, want_max, "{name} n={n}");
                let want_pos = values.iter().position(|&v| v == want_max).unwrap_or(0) as i32;
                assert_eq!(stats.argmax, want_pos, "{name} n={n}");
                let lse = reference_lse(&values, 1.0);
                // Each kernel's exponential is good to ~1.5e-7 relative: so is the sum.
                assert!((stats.lse - lse).abs() < 5e-7, "{name} n={n}: {} vs {lse}", stats.lse);
                if let Some(s) = scale {
                    let want = reference_lse(&values, f64::from(s));
                    let got = stats.scaled.map(|x| x.lse).unwrap_or(f64::NAN);
                    assert!((got - want).abs() < 5e-7, "{name} n={n} s={s}: {got} vs {want}");
                }
            }
        }
    }
}

#[test]
fn scan_row_rebases_when_a_later_block_holds_a_new_maximum() {
    // The maximum rises block after block: every block rescales the sums before it.
    let values: Vec<f32> =
        (0..5 * BLOCK).map(|i| (i / BLOCK) as f32 * 30.0 + (i % 97) as f32 / 97.0).collect();
    let mut copy = Vec::new();
    let mut maxima = Vec::new();
    let stats = scan_row(&values, Some(&mut copy), &mut maxima, Some(2.0));
    assert_eq!(copy, values);
    assert_eq!(maxima.len(), 5 * BLOCK / SPAN);
    assert!((stats.lse - reference_lse(&values, 1.0)).abs() < 1e-5);
    assert!((stats.scaled_lse(2.0).unwrap_or(f64::NAN) - reference_lse(&values, 2.0)).abs() < 1e-5);
    assert_eq!(stats.scaled_lse(3.0), None, "asked for another scale");
}

#[test]
fn degenerate_rows() {
    let stats = row_stats(&[]);
    assert_eq!((stats.max, stats.argmax, stats.lse), (f32::NEG_INFINITY, 0, f64::NEG_INFINITY));
    let stats = row_stats(&[f32::NEG_INFINITY; 100]);
    assert_eq!((stats.max, stats.argmax, stats.lse), (f32::NEG_INFINITY, 0, f64::NEG_INFINITY));
    let mut one = vec![f32::NEG_INFINITY; 300];
    one[250] = 3.5;
    let stats = row_stats(&one);
    assert_eq!((stats.max, stats.argmax, stats.lse), (3.5, 250, 3.5), "one finite value is its own lse");
    let mut inf = vec![0.0f32; 70];
    inf[66] = f32::INFINITY;
    let stats = row_stats(&inf);
    assert_eq!((stats.max, stats.argmax, stats.lse), (f32::INFINITY, 66, f64::INFINITY));
    // Scale 1 (or none) computes no second sum.
    assert_eq!(scan_row(&[1.0, 2.0], None, &mut Vec::new(), Some(1.0)).scaled, None);
}

#[test]
fn rows_scanned_part_by_part_on_threads_match_scan_row_bit_for_bit() {
    let mut rows: Vec<Vec<f32>> =
        [0usize, 7, PART, PART + 1, 262_144].iter().map(|&n| row(n, n as u64 + 3)).collect();
    // The maximum in the last part, twice: the first position wins across parts.
    rows[4][3 * PART + 10] = 40.0;
    rows[4][3 * PART + 900] = 40.0;
    rows[3][PART] = f32::INFINITY; // an infinite value alone in the second part
    let scales = [Some(1.25f32), None, Some(0.5), Some(2.0), Some(1.0 / 0.8)];
    for threads in [1, 8] {
        let mut maxima: Vec<Vec<f32>> = vec![vec![9.0; 3]; rows.len()]; // stale buffers are replaced
        let jobs = rows
            .iter()
            .zip(&mut maxima)
            .zip(scales)
            .map(|((src, maxima), scale)| RowJob { src, maxima, scale })
            .collect();
        // The jobs run backwards, each on a thread of its own: with 8 threads for 5 rows, a part
        // per job (0 + 1 + 1 + 2 + 4), with 1 a row per job (5).
        let stats = scan_rows(jobs, threads, |n, job| {
            assert_eq!(n, if threads == 1 { 5 } else { 8 });
            std::thread::scope(|s| {
                for i in (0..n).rev() {
                    s.spawn(move || job(i));
                }
            });
        });
        assert_eq!(stats[4].argmax, (3 * PART + 10) as i32);
        for (i, src) in rows.iter().enumerate() {
            let mut want_maxima = Vec::new();
            let want = scan_row(src, None, &mut want_maxima, scales[i]);
            assert_eq!(maxima[i], want_maxima, "row {i} maxima");
            assert_eq!(
                (stats[i].max.to_bits(), stats[i].argmax),
                (want.max.to_bits(), want.argmax),
                "row {i}"
            );
            assert_eq!(stats[i].lse.to_bits(), want.lse.to_bits(), "row {i} lse");
            assert_eq!(
                stats[i].scaled.map(|s| s.lse.to_bits()),
                want.scaled.map(|s| s.lse.to_bits()),
                "row {i}"
            );
        }
        assert!((stats[4].lse - reference_lse(&rows[4], 1.0)).abs() < 1e-5);
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn each_widths_exp2_is_good_to_2e_7_over_the_range_it_sums() {
    // u from -130 to 0 in steps of 1/64 and 1/7 (whole numbers, halves and their neighbours:
    // where AVX2's rounding splits u), then -inf and NaN, which count as -126 on AVX2.
    let mut us: Vec<f32> = (0..=130 * 64).map(|i| -(i as f32) / 64.0).collect();
    us.extend((0..=130 * 7).map(|i| -(i as f32) / 7.0));
    us.extend([-0.5 - f32::EPSILON, -0.5 + f32::EPSILON / 2.0, f32::NEG_INFINITY, f32::NAN]);
    us.resize(us.len().next_multiple_of(16), 0.0);
    let check = |name: &str, us: &[f32], got: &[f32]| {
        for (&u, &e) in us.iter().zip(got) {
            let want = if u.is_nan() { -126.0 } else { f64::from(u).max(-126.0) }.exp2();
            assert!(((f64::from(e) - want) / want).abs() < 2e-7, "{name}: 2^{u} = {e}, not {want}");
        }
        assert_eq!(got[0], 1.0, "{name}: 2^0 is exact");
    };
    if let Some(got) = x86::exp2_each(false, &us) {
        check("avx2", &us, &got);
    }
    // the AVX-512 kernel holds `y` at -87.3 (NaN too) before its exp2: normal floats only
    let normal: Vec<f32> = us.iter().map(|&u| if u.is_nan() { 0.0 } else { u.max(-126.0) }).collect();
    if let Some(got) = x86::exp2_each(true, &normal) {
        check("avx512", &normal, &got);
    }
}
