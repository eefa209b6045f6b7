#![no_std]
// Only so that cargo sees a library target (as in aya-template): the programs are the binary, main.rs.
