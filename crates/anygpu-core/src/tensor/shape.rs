//! Shapes and strided layouts. Shape letters used across the project (llm.c's habit):
//! B batch, T sequence, C channels (model width), H heads, D head dim, V vocabulary.

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: &[usize]) -> Shape {
        Shape(dims.to_vec())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }
    /// Row-major strides in elements.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }
    /// Element count with an overflow check, for shapes that come from files or users.
    pub fn checked_numel(dims: &[usize]) -> Result<usize> {
        dims.iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| Error::shape("shape", format!("{dims:?} has more elements than fit in memory")))
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Shape {
        Shape(d.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Shape {
        Shape(d.to_vec())
    }
}
impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Shape {
        Shape(d)
    }
}

/// Where a tensor's elements sit in its storage: shape, strides (in elements) and offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub shape: Shape,
    pub strides: Vec<usize>,
    pub offset: usize,
}

impl Layout {
    pub fn contiguous(shape: Shape) -> Layout {
        let strides = shape.contiguous_strides();
        Layout { shape, strides, offset: 0 }
    }
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&d, &s) in self.shape.0.iter().zip(&self.strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected *= d;
        }
        true
    }
    /// Storage index of every element, in row-major order of the logical shape.
    pub fn storage_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let dims = self.shape.dims();
        let n = self.shape.numel();
        let mut idx = vec![0usize; dims.len()];
        let mut pos = self.offset;
        (0..n).map(move |i| {
            if i > 0 {
                // odometer increment
                for ax in (0..dims.len()).rev() {
                    idx[ax] += 1;
                    pos += self.strides[ax];
                    if idx[ax] < dims[ax] {
                        break;
                    }
                    pos -= self.strides[ax] * dims[ax];
                    idx[ax] = 0;
                }
            }
            pos
        })
    }
}
