//! Series of any length reduced to a bounded number of time columns,
//! keeping in each column the lowest and the highest point of every
//! figure (at their own times), so a line drawn from them has the shape
//! of the full one and its maximum is the full one's exactly.
//!
//! The entries come one at a time and the run's length is not known
//! beforehand: columns start narrow, and when a point falls beyond the
//! last one, neighbours are merged pairwise and the width doubles. So at
//! most [`MAX_COLUMNS`] columns are held, and at the end at least half
//! as many cover the run (fewer only for a short one).

/// Most columns held per series (the page is rarely wider in pixels).
pub(crate) const MAX_COLUMNS: usize = 2000;

/// Width of the first columns, seconds.
const FIRST_WIDTH: f64 = 1e-3;

/// The lowest and highest point of one figure in one column.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Band {
    lo: (f64, f64),
    hi: (f64, f64),
}

impl Band {
    fn new(t: f64, v: f64) -> Band {
        Band {
            lo: (t, v),
            hi: (t, v),
        }
    }

    fn absorb(&mut self, o: &Band) {
        if o.lo.1 < self.lo.1 {
            self.lo = o.lo;
        }
        if o.hi.1 > self.hi.1 {
            self.hi = o.hi;
        }
    }
}

/// Something a column holds and can merge with its later neighbour.
pub(crate) trait Cell: Default + Clone {
    fn merge(&mut self, later: Self);
}

/// `N` figures' bands per column.
impl<const N: usize> Cell for [Option<Band>; N]
where
    [Option<Band>; N]: Default,
{
    fn merge(&mut self, later: Self) {
        for (mine, theirs) in self.iter_mut().zip(later) {
            match (mine.as_mut(), theirs) {
                (Some(m), Some(t)) => m.absorb(&t),
                (None, t) => *mine = t,
                (Some(_), None) => {}
            }
        }
    }
}

/// Columns of `C` over time.
#[derive(Debug, Clone)]
pub(crate) struct Columns<C> {
    origin: Option<f64>,
    width: f64,
    cells: Vec<C>,
}

impl<C: Cell> Default for Columns<C> {
    fn default() -> Self {
        Columns {
            origin: None,
            width: FIRST_WIDTH,
            cells: Vec::new(),
        }
    }
}

impl<C: Cell> Columns<C> {
    /// The cell covering time `t` (a time before the first goes to the
    /// first column; a time that is not finite to none).
    pub(crate) fn at(&mut self, t: f64) -> Option<&mut C> {
        if !t.is_finite() {
            return None;
        }
        let origin = *self.origin.get_or_insert(t);
        let mut i = column(t, origin, self.width);
        while i >= MAX_COLUMNS {
            self.halve();
            i = column(t, origin, self.width);
        }
        if self.cells.len() <= i {
            self.cells.resize(i + 1, C::default());
        }
        Some(&mut self.cells[i])
    }

    /// Merges neighbours pairwise and doubles the width.
    fn halve(&mut self) {
        let mut merged = Vec::with_capacity(self.cells.len().div_ceil(2));
        let mut it = std::mem::take(&mut self.cells).into_iter();
        while let Some(mut a) = it.next() {
            if let Some(b) = it.next() {
                a.merge(b);
            }
            merged.push(a);
        }
        self.cells = merged;
        self.width *= 2.0;
    }

    pub(crate) fn cells(&self) -> &[C] {
        &self.cells
    }

    /// The width of one column, seconds.
    pub(crate) fn width(&self) -> f64 {
        self.width
    }
}

fn column(t: f64, origin: f64, width: f64) -> usize {
    let i = ((t - origin) / width).floor();
    if i > 0.0 {
        // Saturates for absurd times; the caller halves until it fits.
        i.min(usize::MAX as f64) as usize
    } else {
        0
    }
}

/// `N` figures sampled together, reduced to columns.
#[derive(Debug, Clone)]
pub(crate) struct Bands<const N: usize>
where
    [Option<Band>; N]: Default,
{
    columns: Columns<[Option<Band>; N]>,
}

impl<const N: usize> Default for Bands<N>
where
    [Option<Band>; N]: Default,
{
    fn default() -> Self {
        Bands {
            columns: Columns::default(),
        }
    }
}

impl<const N: usize> Bands<N>
where
    [Option<Band>; N]: Default,
{
    /// Adds the figures measured at `t` (`None`: not measured then).
    pub(crate) fn push(&mut self, t: f64, values: [Option<f64>; N]) {
        let Some(cell) = self.columns.at(t) else {
            return;
        };
        for (slot, v) in cell.iter_mut().zip(values) {
            let Some(v) = v.filter(|v| v.is_finite()) else {
                continue;
            };
            let b = Band::new(t, v);
            match slot {
                Some(s) => s.absorb(&b),
                None => *slot = Some(b),
            }
        }
    }

    /// Figure `k` as a flat `[t, v, t, v, …]` line in time order, times
    /// made relative to `t0`: each column's low and high points.
    pub(crate) fn line(&self, k: usize, t0: f64) -> Vec<f64> {
        let mut out = Vec::new();
        for cell in self.columns.cells() {
            let Some(b) = cell[k] else { continue };
            let (first, second) = if b.lo.0 <= b.hi.0 {
                (b.lo, b.hi)
            } else {
                (b.hi, b.lo)
            };
            out.extend([first.0 - t0, first.1]);
            if second != first {
                out.extend([second.0 - t0, second.1]);
            }
        }
        out
    }

    /// The highest value of figure `k`.
    pub(crate) fn max(&self, k: usize) -> Option<f64> {
        self.columns
            .cells()
            .iter()
            .filter_map(|c| c[k].map(|b| b.hi.1))
            .reduce(f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_series_keeps_its_shape_its_extremes_and_a_bounded_size() {
        let mut b: Bands<1> = Bands::default();
        let n = 1_000_000;
        for i in 0..n {
            let t = 1000.0 + i as f64 * 0.01;
            let v = match i {
                123_457 => 5000.0,
                777_777 => -3.0,
                _ => (i % 100) as f64,
            };
            b.push(t, [Some(v)]);
        }
        let line = b.line(0, 1000.0);
        let points = line.len() / 2;
        assert!(points <= 2 * MAX_COLUMNS, "{points}");
        assert!(points >= MAX_COLUMNS / 2, "{points}");
        let ys: Vec<f64> = line.chunks(2).map(|p| p[1]).collect();
        assert_eq!(ys.iter().copied().fold(f64::MIN, f64::max), 5000.0);
        assert_eq!(ys.iter().copied().fold(f64::MAX, f64::min), -3.0);
        assert_eq!(b.max(0), Some(5000.0));
        // The peak keeps its own time.
        let at = line.chunks(2).find(|p| p[1] == 5000.0).unwrap()[0];
        assert!((at - 1234.57).abs() < 1e-6, "{at}");
        // Times only go forward.
        assert!(line
            .chunks(2)
            .zip(line.chunks(2).skip(1))
            .all(|(a, b)| a[0] <= b[0]));
    }

    #[test]
    fn a_short_series_is_kept_point_for_point() {
        let mut b: Bands<2> = Bands::default();
        for (i, v) in [3.0, 1.0, 4.0, 1.0, 5.0].iter().enumerate() {
            b.push(10.0 + i as f64, [Some(*v), None]);
        }
        assert_eq!(
            b.line(0, 10.0),
            [0.0, 3.0, 1.0, 1.0, 2.0, 4.0, 3.0, 1.0, 4.0, 5.0]
        );
        assert!(b.line(1, 10.0).is_empty());
        assert_eq!(b.max(1), None);
    }

    #[test]
    fn hostile_times_and_values_are_bounded() {
        let mut b: Bands<1> = Bands::default();
        b.push(f64::NAN, [Some(1.0)]);
        b.push(1.0, [Some(f64::INFINITY)]);
        b.push(1.0, [Some(2.0)]);
        b.push(1e300, [Some(3.0)]);
        b.push(-1e300, [Some(4.0)]);
        assert!(b.columns.cells().len() <= MAX_COLUMNS);
        assert_eq!(b.max(0), Some(4.0));
    }
}
