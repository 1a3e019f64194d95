//! Python classes that wrap a core value (`PyEngineStats(EngineStats)`): the struct is written
//! once, in the core; the class's read-only properties read its fields and its `repr` lists
//! them as a dataclass's does.

/// A field's value as Python's `repr` writes it.
pub(crate) trait PyRepr {
    fn py_repr(&self) -> String;
}

impl PyRepr for bool {
    fn py_repr(&self) -> String {
        (if *self { "True" } else { "False" }).to_string()
    }
}

macro_rules! display_repr {
    ($($t:ty),*) => {
        $(impl PyRepr for $t {
            fn py_repr(&self) -> String {
                self.to_string()
            }
        })*
    };
}

display_repr!(u32, u64, usize);

impl PyRepr for f64 {
    /// Rust's shortest round-trip form, which switches to an exponent where Python's does;
    /// the exponent written Python's way (`1e-05`, `1e+16`).
    fn py_repr(&self) -> String {
        if self.is_nan() {
            return "nan".into();
        }
        let s = format!("{self:?}");
        match s.split_once('e') {
            Some((mantissa, exp)) => {
                let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
                format!("{mantissa}e{sign}{digits:0>2}")
            }
            None => s,
        }
    }
}

/// `wrapper_class! { /// doc \n "Name" PyType(CoreType) { /// doc \n field: Type, ... } }`: a
/// frozen `lloyal._lloyal.Name` class holding the core value, a `#[getter]` per field (the
/// doc text is the property's docstring) and a `repr` of every field.
macro_rules! wrapper_class {
    (
        $(#[doc = $class_doc:expr])*
        $py_name:literal $class:ident($core:ty) { $($(#[doc = $doc:expr])* $name:ident: $ty:ty,)* }
    ) => {
        $(#[doc = $class_doc])*
        #[pyclass(name = $py_name, module = "lloyal._lloyal", frozen, eq)]
        #[derive(Clone, PartialEq)]
        pub struct $class(pub $core);

        #[pymethods]
        impl $class {
            $(
                $(#[doc = $doc])*
                #[getter]
                fn $name(&self) -> $ty {
                    self.0.$name
                }
            )*

            fn __repr__(&self) -> String {
                use $crate::wrap::PyRepr;
                let fields: Vec<String> =
                    vec![$(format!("{}={}", stringify!($name), self.0.$name.py_repr())),*];
                format!("{}({})", $py_name, fields.join(", "))
            }
        }
    };
}

pub(crate) use wrapper_class;
